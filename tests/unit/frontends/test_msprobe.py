"""moegrad.msprobe against the real mindstudio-probe from PyPI: registration, msprobe's registry, bits, acc_check.

Every test registers into a COPY of the msprobe package (a temporary folder put first on the path
of a subprocess, or a skeleton of its three files), never into an installed one. msprobe is found
in ``MOEGRAD_MSPROBE_TEST_PATH`` (a folder holding ``msprobe`` and the modules its import needs,
e.g. ``pip install --no-deps --target DIR mindstudio-probe==26.2.0 pandas python-dateutil pytz
tzdata six tqdm einops tensorboard absl-py``) or else in this Python; without it the tests skip.

Oracles: the registry's keys from msprobe's own ``function_factory`` (fresh caches, in a fresh
subprocess); grad_x bits from slow per-row loops written here from the documented orders (the
sequential chain from +0.0; the A2/A3 MoeTokenPermuteGrad kernel's chain from the first slot's
row; one float32 add for K <= 2), compared as unsigned integers and, as a second check, with
:func:`moegrad.moe_init_routing_v2_grad`; the forward from a hand example of the routing's
definition (aclnnMoeTokenPermute's formula, MindSpeed's eager equivalent); acc_check's verdicts
from msprobe's own CSV, its NPU half played by the loops here (two substitutions, named in
``_worker_acc_check``: the lookup of torch_npu's function and the device, which torch_npu provides).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moegrad  # noqa: E402
from moegrad._msprobe_install import (  # noqa: E402
    MIN_MSPROBE_VERSION,
    MsprobeSetupError,
    find_msprobe,
    main,
    register,
    status,
    unregister,
)

HERE = Path(__file__).resolve()
INSTALL_HINT = (
    "mindstudio-probe is not installed: pip install --no-deps --target DIR mindstudio-probe==26.2.0 pandas "
    "python-dateutil pytz tzdata six tqdm einops tensorboard absl-py, then MOEGRAD_MSPROBE_TEST_PATH=DIR"
)
FILES = (  # the files register reads or writes, and what it needs to recognise an msprobe
    "__init__.py",
    "_build_info.py",
    "pytorch/__init__.py",
    "pytorch/dump/function_factory.py",
    "pytorch/bench_functions/fusion_operator_config.yaml",
    "pytorch/api_accuracy_checker/acc_check/torch_ut_setting.json",
)
OPERATORS = ("npu_moe_token_permute", "npu_moe_init_routing_v2")
BF16 = np.dtype(ml_dtypes.bfloat16)
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _msprobe_site() -> tuple[Path | None, list[str]]:
    """The folder holding the real ``msprobe`` package, and the path entries its imports need."""
    extra = os.environ.get("MOEGRAD_MSPROBE_TEST_PATH")
    if extra:
        site = Path(extra).resolve()
        return (site if (site / "msprobe" / "__init__.py").is_file() else None), [str(site)]
    spec = importlib.util.find_spec("msprobe")
    if spec is None or not spec.submodule_search_locations:
        return None, []
    return Path(next(iter(spec.submodule_search_locations))).parent, []


SITE, EXTRA_PATH = _msprobe_site()


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(UINT[array.dtype.itemsize])


# --------------------------------------------------------------------------------------------------
# Oracles: slow loops from the documented orders (docs/semantics.md, docs/msprobe.md)
# --------------------------------------------------------------------------------------------------


def chain(rows: np.ndarray, index: np.ndarray, top_k: int, valid, *, from_first: bool) -> np.ndarray:
    """float32 sums slot by slot: from +0.0 (sequential), or from the first slot's row (A2/A3's
    MoeTokenPermuteGrad: slot 0 copied when valid, else +0.0; later valid slots added)."""
    tokens, hidden = index.size // top_k, rows.shape[-1]
    flat = rows.reshape(-1, hidden).astype(np.float32)
    out = np.empty((tokens, hidden), np.float32)
    for i in range(tokens):
        acc = None if from_first else np.zeros(hidden, np.float32)
        for t in range(top_k):
            row = int(index[i * top_k + t])
            if not valid(row):
                acc = np.zeros(hidden, np.float32) if acc is None else acc
                continue
            acc = flat[row].copy() if acc is None else np.add(acc, flat[row], dtype=np.float32)
        out[i] = acc
    return out


def one_add(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """K = 2, every slot valid, no -0.0: every order is the one float32 add of the two rows."""
    flat = rows.astype(np.float32)
    return np.add(flat[index[0::2]], flat[index[1::2]], dtype=np.float32)


def routing_index(expert_idx: np.ndarray) -> np.ndarray:
    """slot -> row: the stable sort of the flat ids (MindSpeed's eager_permute), inverted."""
    order = np.argsort(expert_idx.reshape(-1), kind="stable")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return inverse.astype(np.int32)


def case_inputs(seed: int, tokens: int, top_k: int, hidden: int, rows: int | None = None):
    rng = np.random.default_rng(seed)
    expert_idx = np.stack([rng.permutation(8)[:top_k] for _ in range(tokens)]).astype(np.int32)
    index = routing_index(expert_idx)
    grad = rng.standard_normal((rows or tokens * top_k, hidden)).astype(np.float32)
    return grad, index


# name -> (function, profile, device dtype, msprobe's dtype, tokens, K, H, rows (active) or None)
CASES = {
    "routing_f32_sequential": ("routing", "sequential", "float32", "float32", 7, 5, 16, None),
    "routing_f64_sequential": ("routing", "sequential", "float32", "float64", 7, 5, 16, None),
    "routing_bf16_sequential": ("routing", "sequential", "bfloat16", "float32", 6, 7, 24, None),
    "routing_f16_sequential": ("routing", "sequential", "float16", "float32", 6, 3, 24, None),
    "routing_f32_910b_k2": ("routing", "ascend910b", "float32", "float32", 9, 2, 32, None),
    "routing_f64_950_k2": ("routing", "ascend950", "float32", "float64", 9, 2, 32, None),
    "routing_bf16_active_sequential": ("routing", "sequential", "bfloat16", "float32", 8, 4, 16, 19),
    "permute_bf16_910b": ("permute", "ascend910b", "bfloat16", "float32", 8, 6, 16, 29),
    "permute_f64_910b": ("permute", "ascend910b", "float32", "float64", 8, 6, 64, 29),
    "permute_f64_950_k2": ("permute", "ascend950", "float32", "float64", 9, 2, 32, None),
    "permute_f32_950_k1": ("permute", "ascend950", "float32", "float32", 5, 1, 8, 3),
}


SEEDS = {name: seed for seed, name in enumerate(CASES)}


def expected(name: str) -> np.ndarray:
    """The device's grad_x of a case, in its device dtype, from the loops above."""
    function, profile, device, _, tokens, top_k, hidden, rows = CASES[name]
    grad, index = case_inputs(SEEDS[name], tokens, top_k, hidden, rows)
    values = grad.astype(device if device != "bfloat16" else BF16)
    limit = rows or tokens * top_k
    if top_k <= 2 and rows is None:
        total = one_add(values, index) if top_k == 2 else values[index].astype(np.float32)
    elif function == "permute" and profile == "ascend910b":
        total = chain(values, index, top_k, lambda r: r < limit, from_first=True)
    elif profile == "sequential" or (top_k == 1 and function == "permute"):
        total = chain(values, index, top_k, lambda r: r < limit, from_first=False)
    else:
        raise AssertionError(f"no oracle for {name}")
    return total.astype(values.dtype)


# --------------------------------------------------------------------------------------------------
# The subprocess: msprobe imported from the registered copy
# --------------------------------------------------------------------------------------------------


def _env(copy_site: Path) -> dict[str, str]:
    moegrad_root = str(Path(moegrad.__file__).resolve().parents[1])
    entries = [str(copy_site), moegrad_root, *EXTRA_PATH, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(entry for entry in entries if entry)}


def _copy(destination: Path) -> Path:
    """A copy of the real msprobe package under ``destination`` (returns the package folder)."""
    assert SITE is not None
    shutil.copytree(SITE / "msprobe", destination / "msprobe", ignore=shutil.ignore_patterns("__pycache__"))
    return destination / "msprobe"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """Register into a copy with the command line, then run ``_worker`` in a fresh Python; its results."""
    if SITE is None:
        pytest.skip(INSTALL_HINT)
    site = tmp_path_factory.mktemp("site")
    package = _copy(site)
    env = _env(site)
    command = [sys.executable, "-m", "moegrad.msprobe", "register"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert str(package.resolve()) in done.stdout  # it found the copy, first on the path
    out = tmp_path_factory.mktemp("worker")
    run = subprocess.run([sys.executable, str(HERE), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads((out / "report.json").read_text()), np.load(out / "outputs.npz"), site


def _worker_bench(out: Path, report: dict) -> None:
    import msprobe.pytorch.dump.function_factory as factory

    forward, backward = factory.get_npu_custom_functions(), factory.get_npu_custom_grad_functions()
    report["forward"], report["backward"] = sorted(forward.keys()), sorted(backward.keys())
    report["modules"] = {name: forward[name].__module__ for name in OPERATORS}
    outputs = {}
    for name, (function, profile, device, passed, tokens, top_k, hidden, rows) in CASES.items():
        os.environ["MOEGRAD_MSPROBE_ORDER"] = profile  # read by the bench functions at each call
        grad, index = case_inputs(SEEDS[name], tokens, top_k, hidden, rows)
        values = torch.from_numpy(grad.astype(device if device != "bfloat16" else BF16).astype(np.float64))
        values = values.to(getattr(torch, passed))  # msprobe's raised dtype: exact
        if function == "routing":
            result = backward["npu_moe_init_routing_v2_grad"](values, torch.from_numpy(index), top_k, 0, rows or 0)
        else:
            like, ids = torch.empty(tokens, hidden), torch.empty(tokens, top_k, dtype=torch.int32)
            ids = ids if top_k > 1 else ids[:, 0]  # 1-D indices: K = 1
            result = backward["npu_moe_token_permute_grad"](like, values, ids, torch.from_numpy(index))
        outputs[name] = result.numpy()
    os.environ["MOEGRAD_MSPROBE_ORDER"] = "ascend910b"
    tokens = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    ids = torch.tensor([[1, 0], [0, 2], [1, 1]], dtype=torch.int32)
    permuted, sorted_indices = forward["npu_moe_token_permute"](tokens, ids)
    outputs["permute_x"], outputs["permute_idx"] = permuted.numpy(), sorted_indices.numpy()
    outputs["permute_x4"] = forward["npu_moe_token_permute"](tokens, ids, num_out_tokens=4)[0].numpy()
    outputs["permute_xneg"] = forward["npu_moe_token_permute"](tokens, ids, num_out_tokens=-1)[0].numpy()
    for row_idx_type in (0, 1):
        routed = forward["npu_moe_init_routing_v2"](
            tokens.double(), ids, active_num=6, expert_num=3, expert_tokens_num_type=row_idx_type,
            expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, 3], row_idx_type=row_idx_type,
        )
        for i, tensor in enumerate(routed):
            outputs[f"routing{row_idx_type}_{i}"] = tensor.numpy()
    np.savez(out / "outputs.npz", **outputs)


def _npu_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """The NPU half of acc_check, played on the CPU by the loops above (A2/A3's permute backward)."""

    class Permute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, ids):
            index = routing_index(ids.numpy())
            order = np.argsort(ids.numpy().reshape(-1), kind="stable")
            ctx.index, ctx.top_k = index, ids.shape[1]
            return x[torch.from_numpy(order // ids.shape[1])], torch.from_numpy(index)

        @staticmethod
        def backward(ctx, grad, _):
            total = chain(grad.float().numpy(), ctx.index, ctx.top_k, lambda r: r < grad.shape[0], from_first=True)
            return torch.from_numpy(total).to(grad.dtype), None  # one rounding of the float32 sums

    return Permute.apply(tokens, indices)


def _npu_routing(x, expert_idx, **kwargs):
    index = routing_index(expert_idx.numpy())
    order = np.argsort(expert_idx.numpy().reshape(-1), kind="stable")
    counts = np.bincount(expert_idx.numpy().reshape(-1), minlength=kwargs["expert_num"]).astype(np.int64)
    scale = torch.full((index.size,), float("nan"))  # undefined without scale: never compared
    return x[torch.from_numpy(order // expert_idx.shape[1])], torch.from_numpy(index), torch.from_numpy(counts), scale


def _worker_acc_check(out: Path, report: dict) -> None:
    """A dump written here (msprobe's dump.json and .pt files), checked by msprobe's own acc_check."""
    import msprobe.pytorch.api_accuracy_checker.acc_check.acc_check as acc_check
    import msprobe.pytorch.api_accuracy_checker.acc_check.acc_check_utils as utils
    from msprobe.pytorch.api_accuracy_checker.common.config import CheckerConfig
    from msprobe.pytorch.common.parse_json import parse_json_info_forward_backward
    from msprobe.pytorch.dump.api_dump.api_register import ApiTemplate

    data = out / "dump"
    data.mkdir(mode=0o750)
    rng = np.random.default_rng(7)
    tokens = torch.from_numpy(rng.standard_normal((6, 64)).astype(np.float32))  # float32: the order shows
    ids = torch.from_numpy(np.stack([rng.permutation(5)[:3] for _ in range(6)]).astype(np.int32))
    grad = torch.from_numpy(rng.standard_normal((18, 64)).astype(np.float32))
    x = tokens.to(torch.bfloat16)  # the routing's input: bfloat16, raised to float32 by msprobe

    def tensor(name, value, requires_grad):
        torch.save(value, data / name)
        os.chmod(data / name, 0o640)
        low, high = float(value.float().min()), float(value.float().max())
        return {"type": "torch.Tensor", "dtype": str(value.dtype), "shape": list(value.shape), "Max": high,
                "Min": low, "requires_grad": requires_grad, "data_name": name}

    def scalar(value):  # a dumped int or bool argument
        return {"type": type(value).__name__, "value": value}
    permute, routing = "NPU.npu_moe_token_permute.0", "NPU.npu_moe_init_routing_v2.0"
    kwargs = {"active_num": 18, "expert_num": 5, "expert_tokens_num_type": 1, "expert_tokens_num_flag": True,
              "quant_mode": -1, "row_idx_type": 0}
    dump = {"task": "tensor", "level": "L1", "dump_data_dir": str(data), "data": {
        f"{permute}.forward": {"input_args": [tensor("p0.pt", tokens, True), tensor("p1.pt", ids, False)],
                               "input_kwargs": {}, "output": []},
        f"{permute}.backward": {"input": [tensor("pg.pt", grad, False), None], "output": []},
        f"{routing}.forward": {
            "input_args": [tensor("r0.pt", x, False), tensor("r1.pt", ids, False)],
            "input_kwargs": {**{k: scalar(v) for k, v in kwargs.items()},
                             "active_expert_range": [scalar(0), scalar(5)]},
            "output": []},
    }}
    (out / "dump.json").write_text(json.dumps(dump))
    os.chmod(out / "dump.json", 0o640)
    npu = {"npu_moe_token_permute": _npu_permute, "npu_moe_init_routing_v2": _npu_routing}
    turn = {"bench": True}

    def exec_api(params):  # substitution 1: torch_npu's function is not looked up (no torch_npu here)
        bench, turn["bench"] = turn["bench"], not turn["bench"]  # run_torch_api: bench first, then the NPU
        if bench:  # msprobe's own dispatch to the registered bench function
            template = ApiTemplate(params.api_name, None, params.api_type, None, need_hook=False, device="cpu")
            return template.forward(*params.args, **params.kwargs)
        return npu[params.api_name](*params.args, **params.kwargs)

    acc_check.exec_api = exec_api
    acc_check.current_device = utils.current_device = "cpu"  # substitution 2: the NPU half's device
    os.environ["MOEGRAD_MSPROBE_ORDER"] = "ascend910b"
    forward, backward, real = parse_json_info_forward_backward(str(out / "dump.json"))
    results = out / "acc"
    results.mkdir(mode=0o750)
    result_csv = results / "accuracy_checking_result_20260101000000.csv"
    details_csv = results / "accuracy_checking_details_20260101000000.csv"
    config = CheckerConfig().get_acc_check_config(
        forward_content=forward, backward_content=backward, result_csv_path=str(result_csv),
        details_csv_path=str(details_csv), save_error_data=False, is_continue_acc_check=False,
        real_data_path=real, error_data_path=str(results))
    acc_check.acc_check(config)
    report["result_csv"] = result_csv.read_text(encoding="utf-8-sig")
    report["details_csv"] = details_csv.read_text(encoding="utf-8-sig")


def _worker(out: Path) -> None:
    report: dict = {}
    _worker_bench(out, report)
    _worker_acc_check(out, report)
    (out / "report.json").write_text(json.dumps(report))


# --------------------------------------------------------------------------------------------------
# msprobe's registry, the bits, the forward, acc_check
# --------------------------------------------------------------------------------------------------


def test_msprobe_registry_lists_the_operators_and_the_backward_functions(worker):
    report, _, _ = worker
    assert {"npu_moe_token_permute", "npu_moe_init_routing_v2", "npu_fusion_attention"} <= set(report["forward"])
    assert {"npu_moe_token_permute_grad", "npu_moe_init_routing_v2_grad", "npu_fusion_attention_grad"} <= set(
        report["backward"])
    assert report["modules"] == dict.fromkeys(OPERATORS, "moegrad.msprobe")


@pytest.mark.parametrize("name", CASES)
def test_the_backward_bench_function_returns_the_devices_bits(worker, name):
    _, outputs, _ = worker
    function, profile, _, passed, tokens, top_k, hidden, rows = CASES[name]
    got = outputs[name]
    assert got.dtype == np.dtype(passed) and got.shape == (tokens, hidden)
    want = expected(name)
    narrowed = got.astype(want.dtype)
    assert np.array_equal(narrowed.astype(got.dtype), got)  # widened from the device dtype, exactly
    assert np.array_equal(bits(narrowed), bits(want))
    grad, index = case_inputs(SEEDS[name], tokens, top_k, hidden, rows)
    order = {"ascend910b": "sequential"}.get(profile, profile) if function == "permute" else profile
    emulation = moegrad.moe_init_routing_v2_grad(
        grad.astype(want.dtype), index, top_k, 0, rows or (tokens * top_k if function == "permute" else 0), order=order)
    assert np.array_equal(bits(narrowed), bits(emulation))


def test_the_forwards_follow_the_routing_definition(worker):
    _, outputs, _ = worker
    # ids [[1, 0], [0, 2], [1, 1]]: slots by expert, stable: 1, 2 | 0, 4, 5 | 3 -> rows 0..5
    assert outputs["permute_idx"].tolist() == [2, 0, 1, 5, 3, 4] and outputs["permute_idx"].dtype == np.int32
    assert outputs["permute_x"][:, 0].tolist() == [1, 2, 1, 3, 3, 2]  # tokens[slot // 2] row by row
    assert outputs["permute_x4"][:, 0].tolist() == [1, 2, 1, 3]  # num_out_tokens=4: the first four rows
    assert outputs["permute_xneg"][:, 0].tolist() == [1, 2, 1, 3, 3]  # -1: all but the last
    assert outputs["routing0_0"].dtype == np.float64 and outputs["routing0_0"][:, 1].tolist() == [1, 2, 1, 3, 3, 2]
    assert outputs["routing0_1"].tolist() == [2, 0, 1, 5, 3, 4]  # row_idx_type 0: slot -> row
    assert outputs["routing1_1"].tolist() == [1, 2, 0, 4, 5, 3]  # row_idx_type 1: row -> slot
    assert outputs["routing0_2"].tolist() == [2, 5, 6] and outputs["routing0_2"].dtype == np.int64  # cumsum
    assert outputs["routing1_2"].tolist() == [2, 3, 1]  # count
    assert len([key for key in outputs if key.startswith("routing0_")]) == 3  # expanded_scale is not returned


def test_acc_check_passes_the_devices_bits(worker):
    report, _, _ = worker
    lines = report["result_csv"].splitlines()
    assert lines[0].startswith("API name,Forward Test Success,Backward Test Success")
    rows = {line.split(",")[0]: line.split(",")[1:3] for line in lines[1:] if line}
    assert rows["NPU.npu_moe_token_permute.0"] == ["pass", "pass"]
    assert rows["NPU.npu_moe_init_routing_v2.0"][0] == "pass"
    assert rows["NPU.npu_moe_init_routing_v2.0"][1] in ("", " ")  # torch_npu records no backward for it
    details = {row["API Name"]: row for row in csv.DictReader(io.StringIO(report["details_csv"]))}
    for output, dtypes in (
        ("NPU.npu_moe_token_permute.0.forward.output.0", ("torch.float64", "torch.float32")),
        ("NPU.npu_moe_token_permute.0.backward.output.0", ("torch.float64", "torch.float32")),
        ("NPU.npu_moe_init_routing_v2.0.forward.output.0", ("torch.float32", "torch.bfloat16")),
    ):
        row = details[output]  # msprobe's columns: cosine similarity, largest absolute error
        assert (row["Bench Dtype"], row["DEVICE Dtype"], row["Status"]) == (*dtypes, "pass")
        assert float(row["余弦相似度"]) == 1.0 and float(row["最大绝对误差"]) == 0.0
    for output in ("npu_moe_token_permute.0.forward.output.1", "npu_moe_init_routing_v2.0.forward.output.2"):
        assert details[f"NPU.{output}"]["Status"] == "pass"  # the integer outputs: equal
    assert "NPU.npu_moe_init_routing_v2.0.forward.output.3" not in details  # the undefined expanded_scale


def test_msprobe_still_loads_its_own_functions_where_moegrad_cannot_be_imported(worker, tmp_path):
    _, _, site = worker
    broken = tmp_path / "moegrad"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('no moegrad here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(site), *EXTRA_PATH])}
    code = "import msprobe.pytorch.dump.function_factory as f; print(sorted(f.get_npu_custom_functions().keys()))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    names = run.stdout.strip().splitlines()[-1]
    assert "'npu_fusion_attention'" in names and "npu_moe_token_permute" not in names
    assert "moegrad bench functions unavailable: no moegrad here" in run.stdout + run.stderr


# --------------------------------------------------------------------------------------------------
# The bench functions in-process: dtypes, settings, the service path
# --------------------------------------------------------------------------------------------------


def test_the_dtype_setting_decides_the_rounding_of_values_both_half_types_hold(monkeypatch):
    import moegrad.msprobe as bench

    monkeypatch.setenv("MOEGRAD_MSPROBE_ORDER", "sequential")
    grad = torch.tensor([[1.0, 3.0], [2.0**-9, 2.0**-9]])  # every value a bfloat16 and a float16 value
    index = torch.tensor([0, 1], dtype=torch.int32)
    sums = {}
    for setting in ("", "bfloat16", "float16", "float32"):
        monkeypatch.setenv("MOEGRAD_MSPROBE_DTYPE", setting)
        sums[setting] = bench.npu_moe_init_routing_v2_grad(grad, index, 2)[0].tolist()
    # 1 + 2**-9: bfloat16 keeps 8 bits (ties to even: 1.0), float16 11 bits, float32 24 bits
    assert sums[""] == sums["bfloat16"] == [1.0, 3.0]
    assert sums["float16"] == sums["float32"] == [1.0 + 2.0**-9, 3.0 + 2.0**-9]


def test_on_a2_a3_the_permute_backward_differs_from_its_kernel_only_by_the_sign_of_all_negative_zero_rows(
    monkeypatch,
):
    import moegrad.msprobe as bench

    monkeypatch.setenv("MOEGRAD_MSPROBE_ORDER", "ascend910b")
    grad, index = case_inputs(99, 6, 3, 8)
    grad[index[:3]] = -0.0  # token 0: every summand -0.0
    kernel = chain(grad, index, 3, lambda r: True, from_first=True)
    got = bench.npu_moe_token_permute_grad(
        torch.empty(6, 8), torch.from_numpy(grad).double(), torch.empty(6, 3), torch.from_numpy(index)
    ).numpy().astype(np.float32)
    assert np.array_equal(bits(got[1:]), bits(kernel[1:]))
    assert np.array_equal(got[0], kernel[0])  # equal as numbers: +0.0 here, -0.0 on the device
    assert not np.signbit(got[0]).any() and np.signbit(kernel[0]).all()


def test_bad_settings_and_calls_it_does_not_emulate_raise(monkeypatch):
    import moegrad.msprobe as bench

    grad, index = torch.ones(4, 2), torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    monkeypatch.setenv("MOEGRAD_MSPROBE_ORDER", "ascend310")
    with pytest.raises(ValueError, match="MOEGRAD_MSPROBE_ORDER='ascend310': 'ascend310' is not a device profile"):
        bench.npu_moe_init_routing_v2_grad(grad, index, 2)
    monkeypatch.setenv("MOEGRAD_MSPROBE_ORDER", "ascend950")
    monkeypatch.setenv("MOEGRAD_MSPROBE_DTYPE", "half")
    with pytest.raises(ValueError, match="MOEGRAD_MSPROBE_DTYPE='half'"):
        bench.npu_moe_init_routing_v2_grad(grad, index, 2)
    monkeypatch.setenv("MOEGRAD_MSPROBE_DTYPE", "bfloat16")
    with pytest.raises(ValueError, match="not bfloat16 values"):
        bench.npu_moe_init_routing_v2_grad(grad + 2.0**-12, index, 2)
    with pytest.raises(ValueError, match="not float32 values"):
        bench.npu_moe_init_routing_v2_grad(grad.double() + 2.0**-40, index, 2)
    x, ids = torch.ones(2, 2), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="padded_mode"):
        bench.npu_moe_token_permute(x, ids, padded_mode=True)
    with pytest.raises(NotImplementedError, match="quant_mode"):
        bench.npu_moe_init_routing_v2(x, ids, quant_mode=1, active_expert_range=[0, 2])
    with pytest.raises(NotImplementedError, match="outside active_expert_range"):
        bench.npu_moe_init_routing_v2(x, ids, quant_mode=-1, active_expert_range=[1, 2])
    with pytest.raises(moegrad.InvalidArgument):  # the routing's own check: ids are float32 keys
        bench.npu_moe_token_permute(x, ids + 2**24)


def test_with_a_url_the_backwards_go_to_the_service_in_the_profiles_order(monkeypatch):
    import moegrad.msprobe as bench

    calls = []

    class Service:
        def __init__(self, url, token=None):
            self.address = (url, token)

        def moe_init_routing_v2_grad(self, grad, index, top_k, drop_pad_mode, active_num, *, order):
            calls.append((self.address, grad.dtype, top_k, drop_pad_mode, active_num, order))
            return moegrad.moe_init_routing_v2_grad(grad, index, top_k, drop_pad_mode, active_num, order=order)

        def close(self):
            pass

    monkeypatch.setattr(bench, "Client", Service)
    monkeypatch.setattr(bench, "_clients", {})
    monkeypatch.setenv("MOEGRAD_MSPROBE_URL", "http://npu-host:8000")
    monkeypatch.setenv("MOEGRAD_MSPROBE_TOKEN", "secret")
    monkeypatch.setenv("MOEGRAD_MSPROBE_ORDER", "ascend910b")  # an alias: sent as ascend910b@9.1
    grad, index = case_inputs(5, 4, 2, 8, rows=6)
    raised = torch.from_numpy(grad).double()
    got = bench.npu_moe_token_permute_grad(torch.empty(4, 8), raised, torch.empty(4, 2), torch.from_numpy(index))
    assert got.dtype == torch.float64
    bench.npu_moe_init_routing_v2_grad(raised[:6], torch.tensor([2, 0, 1, 5, 3, 4], dtype=torch.int32), 2)
    address = ("http://npu-host:8000", "secret")
    assert calls == [(address, np.float32, 2, 0, 6, "sequential"), (address, np.float32, 2, 0, 0, "ascend910b@9.1")]


# --------------------------------------------------------------------------------------------------
# register / unregister / status on a skeleton copy (the real files), and the command line
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def skeleton(tmp_path):
    if SITE is None:
        pytest.skip(INSTALL_HINT)
    for name in FILES:
        target = tmp_path / "msprobe" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(SITE / "msprobe" / name, target)
    _as_shipped(tmp_path / "msprobe")
    return find_msprobe(tmp_path / "msprobe")


def _as_shipped(package: Path) -> None:
    """The skeleton's files as mindstudio-probe ships them, whatever the environment's msprobe holds.

    An msprobe this Python imports may have moegrad registered (``python -m moegrad.msprobe
    register``, as docs/msprobe.md says to): its YAML then holds moegrad's block and its JSON the two
    operators. Both are taken out of the copies here, with no code of moegrad's: the lines from
    ``# >>> moegrad`` to ``# <<< moegrad``, and the operators' keys (the JSON written back as
    msprobe ships it, two-space indented). Where the wheel's RECORD is beside the package, every copy
    must then have the sha256 it lists; a file changed otherwise skips the test, naming it.
    """
    config = package / "pytorch" / "bench_functions" / "fusion_operator_config.yaml"
    lines = config.read_text(encoding="utf-8").splitlines(keepends=True)
    marks = [i for i, line in enumerate(lines) if line.strip().startswith(("# >>> moegrad", "# <<< moegrad"))]
    if len(marks) == 2:
        config.write_text("".join(lines[: marks[0]] + lines[marks[1] + 1 :]), encoding="utf-8")
    setting = package / "pytorch" / "api_accuracy_checker" / "acc_check" / "torch_ut_setting.json"
    values = json.loads(setting.read_text(encoding="utf-8"))
    if set(OPERATORS) & set(values):
        setting.write_text(json.dumps({k: v for k, v in values.items() if k not in OPERATORS}, indent=2),
                           encoding="utf-8")
    for record in SITE.glob("mindstudio_probe-*.dist-info/RECORD"):
        hashes = dict(row[:2] for row in csv.reader(record.read_text(encoding="utf-8").splitlines()) if len(row) >= 2)
        for name in FILES:
            digest = base64.urlsafe_b64encode(hashlib.sha256((package / name).read_bytes()).digest()).rstrip(b"=")
            if hashes.get(f"msprobe/{name}") not in (None, f"sha256={digest.decode()}"):
                pytest.skip(f"msprobe/{name} of {SITE} is not as {record.parent.name} ships it (its RECORD's "
                            "sha256), beyond moegrad's registration: these tests need msprobe's own files")


def _texts(install):
    return {path: path.read_bytes() for path in (install.config_path, install.ut_setting_path)}


def test_register_adds_a_block_keeps_every_other_byte_and_unregister_restores_them(skeleton):
    import yaml

    before = _texts(skeleton)
    original = yaml.safe_load(before[skeleton.config_path])["operators"]
    register(skeleton)
    once = _texts(skeleton)
    register(skeleton)  # idempotent
    assert _texts(skeleton) == once
    text = skeleton.config_path.read_text(encoding="utf-8")
    block = text[text.index("  # >>> moegrad") : text.index("  # <<< moegrad") + len("  # <<< moegrad\n")]
    assert text.replace(block, "").encode() == before[skeleton.config_path]
    operators = yaml.safe_load(text)["operators"]
    assert {k: v for k, v in operators.items() if k in original} == original
    assert operators["npu_moe_token_permute"]["backward"] == "npu_moe_token_permute_grad"
    assert operators["npu_moe_init_routing_v2"]["forward"] == "npu_moe_init_routing_v2"
    settings = json.loads(skeleton.ut_setting_path.read_text())
    assert settings["npu_moe_token_permute"] == settings["npu_moe_init_routing_v2"] == {"grad_index": 0}
    assert status(skeleton)[0] is True
    unregister(skeleton)
    assert _texts(skeleton) == before and not skeleton.module_path.exists()
    assert status(skeleton)[0] is False
    assert unregister(skeleton) == ["nothing to remove: moegrad's bench functions are not registered here"]


def test_register_refuses_an_operator_registered_by_someone_else(skeleton):
    path = skeleton.config_path
    path.write_text(path.read_text() + "  npu_moe_token_permute:\n    forward: npu_sort_v2\n")
    before = _texts(skeleton)
    with pytest.raises(MsprobeSetupError, match="already registers npu_moe_token_permute"):
        register(skeleton)
    assert _texts(skeleton) == before and not skeleton.module_path.exists()


def test_an_msprobe_without_the_yaml_loader_names_the_version_needed(skeleton):
    skeleton.factory_path.write_text("from msprobe.pytorch.bench_functions.rms_norm import npu_rms_norm\n")
    with pytest.raises(MsprobeSetupError, match=f"mindstudio-probe >= {MIN_MSPROBE_VERSION}"):
        register(skeleton)
    assert "26.2.0" in status(skeleton)[1][-1]


def test_a_folder_that_is_not_writable_is_refused(skeleton, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != skeleton.bench_dir)  # root ignores chmod
    with pytest.raises(MsprobeSetupError, match="is not writable"):
        register(skeleton)


def test_the_command_line(skeleton, capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    usage = capsys.readouterr().out
    for word in ("register", "unregister", "status", "MOEGRAD_MSPROBE_ORDER", "MOEGRAD_MSPROBE_URL", "26.2.0"):
        assert word in usage
    assert main(["status", "--msprobe-dir", str(skeleton.package_dir)]) == 1
    assert main(["register", "--msprobe-dir", str(skeleton.package_dir)]) == 0
    assert main(["status", "--msprobe-dir", str(skeleton.package_dir)]) == 0
    assert "registered" in capsys.readouterr().out.splitlines()[-1]
    assert main(["register", "--msprobe-dir", str(tmp_path / "nowhere")]) == 1
    assert "is not an msprobe package folder" in capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert main(["status"]) == 1
    assert "mindstudio-probe is not installed" in capsys.readouterr().err


if __name__ == "__main__":  # the subprocess of the ``worker`` fixture
    _worker(Path(sys.argv[1]))
