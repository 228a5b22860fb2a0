"""moegrad benchmarks: `python -m bench.run [--quick|--full]` writes bench/RESULTS.md."""
