"""The PyTriton peer: the naive NumPy MoE routing backward served by PyTriton (Triton + Python proxy).

Runs under the Python 3.12 venv that :mod:`bench.pytriton_peer.setup` builds (PyTriton 0.7 ships a
Triton server linked against libpython3.12), never under moegrad's own venv, and imports nothing of
moegrad. It serves one model under moegrad's v2 model name, so the very same tritonclient request
(inputs ``grad_expanded_x`` FP32 [rows, H] and ``expanded_row_idx`` INT32 [N*K], request parameter
``top_k``) goes to either server:

    grad_x = grad_expanded_x.astype(float32)[expanded_row_idx.reshape(N, K)].sum(1), cast back

HTTP only, on the loopback address (gRPC, metrics, SageMaker and Vertex AI are off); no dynamic
batching (``batching=False``). Stops on SIGINT or SIGTERM.

Usage (LD_LIBRARY_PATH must hold the 3.12 interpreter's lib folder)::

    bench/_out/pytriton-venv/bin/python bench/pytriton_peer/server.py --port 8010
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import numpy as np
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

MODEL_NAME = "moe_init_routing_v2_grad"


def naive_grad(grad_expanded_x: np.ndarray, expanded_row_idx: np.ndarray, top_k: int) -> np.ndarray:
    """The textbook NumPy form of the operator (dropless mode): gather, widen, sum over K, narrow."""
    tokens = expanded_row_idx.shape[0] // top_k
    gathered = grad_expanded_x.astype(np.float32)[expanded_row_idx.reshape(tokens, top_k)]
    return gathered.sum(1).astype(grad_expanded_x.dtype)


def infer(requests):
    """PyTriton's unbatched inference callable: one output dict per request."""
    replies = []
    for request in requests:
        top_k = int((request.parameters or {}).get("top_k", 0))
        if top_k <= 0:
            raise ValueError("the request parameter top_k must be a positive integer")
        replies.append({"grad_x": naive_grad(request["grad_expanded_x"], request["expanded_row_idx"], top_k)})
    return replies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback only in the bench)")
    parser.add_argument("--port", type=int, required=True, help="HTTP port")
    parser.add_argument("--workspace", default=None,
                        help="PyTriton's workspace folder (default: its own temporary one); removed on exit")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    config = TritonConfig(http_address=args.host, http_port=args.port, allow_grpc=False, allow_metrics=False,
                          allow_sagemaker=False, allow_vertex_ai=False, exit_on_error=True)
    with Triton(config=config, workspace=args.workspace) as triton:
        triton.bind(
            model_name=MODEL_NAME,
            infer_func=infer,
            inputs=[Tensor(name="grad_expanded_x", dtype=np.float32, shape=(-1, -1)),
                    Tensor(name="expanded_row_idx", dtype=np.int32, shape=(-1,))],
            outputs=[Tensor(name="grad_x", dtype=np.float32, shape=(-1, -1))],
            config=ModelConfig(batching=False),
            strict=True,
        )
        # serve() handles SIGINT (KeyboardInterrupt); turn SIGTERM into the same clean stop.
        signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
        triton.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
