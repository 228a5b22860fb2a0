"""moegrad benchmarks (issue 7): `python -m bench.run [--quick|--full]` writes bench/RESULTS.md."""
