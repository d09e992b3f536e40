"""Stand-in for ``sgl_kernel`` so real SGLang starts on a CPU without its compiled kernels.

CPU-test glue, not a kernel library. ``pip install sglang`` pins ``sglang-kernel``, whose
only compiled ops target sm90/sm100 GPUs, and no source release with the CPU kernels exists on
the registry. SGLang imports a few names from ``sgl_kernel`` while it starts, so this package
defines exactly those names; each raises ``NotImplementedError`` if SGLang ever calls it.
Nothing here registers ``torch.ops.sgl_kernel.*``, so SGLang's capability checks (for example
``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`` for AMX) come out False and it
uses its native torch layers instead.

It lives only on the engine's ``PYTHONPATH`` (written by ``engine_adapter.sglang_cpu setup``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__version__ = "0.0.0+tollgate.cpu.stub"


def _unavailable(name: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is a Tollgate CPU stand-in; the real kernel is not installed"
        )

    op.__name__ = op.__qualname__ = name
    return op


# SGLang modules import these at start-up under ``if _is_cpu:``. The test server calls none of
# them: they serve speculative decoding and KV moves between pools, which it does not enable.
_CPU_OPS_IMPORTED_AT_START = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)
globals().update({name: _unavailable(name) for name in _CPU_OPS_IMPORTED_AT_START})
