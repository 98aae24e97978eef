"""The non-GEMM work of a layer, measured as the simulator prices it: attention, elementwise
chains and a kernel's host dispatch.

``calibrate.measure_gemm`` gives the matmul plateau; a layer also runs attention (priced at
``flash_attention_efficiency`` of that plateau), memory-bound elementwise work (priced at
``memory_bandwidth_gbps x memory_bandwidth_efficiency``) and pays the host's dispatch per kernel
(``kernel_launch_us``). Data sheets guess these; eager PyTorch on a CPU runs its elementwise
chains far below the copy bandwidth (autograd saves, temporaries, one thread), and its attention
kernel at another efficiency than its GEMMs. Each figure here is the simulator's own formula
solved for the one input it takes from the profile, at the shapes the accelerator's models run:

- **attention**: ``F.scaled_dot_product_attention`` (causal) forward + backward; the simulator
  counts ``2 * tok * seq * h`` FLOPs forward for causal flash attention and 2.5x that backward;
  efficiency = that rate / the fitted GEMM plateau of the precision.
- **elementwise**: RMSNorm, SwiGLU's ``silu(a) * b`` and a residual add, forward + backward; the
  simulator counts 2 + 3 elements of the hidden width and 3 of the MLP width per token forward
  (read + write), twice that backward; efficiency = that traffic's rate / the copy bandwidth.
- **dispatch**: a one-element op, host time per call (``kernel_launch_us``).
- **the step's fixed cost**: an AdamW step over one-element parameters, per tensor
  (``optimizer_us_per_tensor``): the overhead of a step that scales with the model's parameter
  tensors and not with their bytes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = [
    "timed",
    "KERNEL_SHAPES",
    "measure_attention",
    "measure_elementwise",
    "measure_dispatch",
    "measure_optimizer_step",
]

# (batch, heads, seq, head_dim, hidden, ffn, dtype) per accelerator: the tiny probes' layer on the
# CPU, a Llama-2-7B layer on accelerators.
KERNEL_SHAPES: dict[str, dict[str, Any]] = {
    "cpu": dict(batch=2, heads=8, seq=256, head_dim=32, hidden=256, ffn=688, dtype="fp32"),
    "cuda": dict(batch=1, heads=32, seq=4096, head_dim=128, hidden=4096, ffn=11008, dtype="bf16"),
    "npu": dict(batch=1, heads=32, seq=4096, head_dim=128, hidden=4096, ffn=11008, dtype="bf16"),
}


def timed(fn: Callable[[], Any], sync: Callable[[], None], min_time_s: float, repeats: int) -> float:
    """Median seconds per call: warm-up, then ``repeats`` batches of calls lasting >= min_time_s
    (device-synchronised after each batch, so a small kernel's issue rate is what is timed)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, int(min_time_s / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _dtype(torch: Any, name: str) -> Any:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def measure_attention(
    accelerator: str, torch: Any, device: Any, sync: Callable[[], None], min_time_s: float, repeats: int
) -> dict[str, Any]:
    """TFLOPS of causal SDPA forward + backward, counted as the simulator counts flash attention."""
    shape = KERNEL_SHAPES[accelerator]
    b, heads, seq, hd = shape["batch"], shape["heads"], shape["seq"], shape["head_dim"]
    dtype = _dtype(torch, shape["dtype"])
    q, k, v = (torch.randn(b, heads, seq, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, seq, hd, device=device, dtype=dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step() -> None:
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True).backward(grad)

    seconds = timed(step, sync, min_time_s, repeats)
    flops = 3.5 * 4.0 * b * seq * seq * heads * hd * 0.5  # forward 2 b s^2 h (causal half), backward 2.5x
    return {"dtype": shape["dtype"], "seconds": seconds, "tflops": flops / seconds / 1e12}


def measure_elementwise(
    accelerator: str, torch: Any, device: Any, sync: Callable[[], None], min_time_s: float, repeats: int
) -> dict[str, Any]:
    """GB/s of a layer's elementwise chain forward + backward, the bytes as the simulator counts them."""
    shape = KERNEL_SHAPES[accelerator]
    tok, h, ffn = shape["batch"] * shape["seq"], shape["hidden"], shape["ffn"]
    dtype = _dtype(torch, shape["dtype"])
    x = torch.randn(tok, h, device=device, dtype=dtype, requires_grad=True)
    res = torch.randn(tok, h, device=device, dtype=dtype, requires_grad=True)
    weight = torch.ones(h, device=device, dtype=dtype, requires_grad=True)
    gate = torch.randn(tok, ffn, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn(tok, ffn, device=device, dtype=dtype, requires_grad=True)
    grad_h = torch.randn(tok, h, device=device, dtype=dtype)
    grad_f = torch.randn(tok, ffn, device=device, dtype=dtype)
    silu = torch.nn.functional.silu

    def step() -> None:
        for t in (x, res, weight, gate, up):
            t.grad = None
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight  # RMSNorm
        # a residual add after it, and SwiGLU's elementwise part; backward from given gradients
        torch.autograd.backward([normed + res, silu(gate) * up], [grad_h, grad_f])

    seconds = timed(step, sync, min_time_s, repeats)
    elements = 3.0 * ((2.0 + 3.0) * tok * h + 3.0 * tok * ffn)  # forward + 2x backward
    nbytes = elements * torch.empty((), dtype=dtype).element_size()
    return {"dtype": shape["dtype"], "seconds": seconds, "gbps": nbytes / seconds / 1e9}


def measure_dispatch(torch: Any, device: Any, sync: Callable[[], None], min_time_s: float, repeats: int) -> float:
    """Seconds the host spends issuing one small kernel (a one-element add), synchronised once
    per batch of calls so the device's own time is hidden behind the issue rate."""
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    return timed(lambda: torch.add(a, b), sync, min_time_s, repeats)


def measure_optimizer_step(
    torch: Any, device: Any, sync: Callable[[], None], min_time_s: float, repeats: int, tensors: int = 64
) -> float:
    """Seconds per parameter tensor of an optimizer step's fixed cost: AdamW (the probe's) over
    ``tensors`` one-element parameters, gradients handed over and cleared as a training step does;
    the bytes are nil, so what is timed is the host's work per tensor."""
    params = [torch.zeros(1, device=device, requires_grad=True) for _ in range(tensors)]
    grads = [torch.ones(1, device=device) for _ in params]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, sync, min_time_s, repeats) / tensors
