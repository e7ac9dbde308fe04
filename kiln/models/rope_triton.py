"""The RoPE rotation's arithmetic in Triton, one helper for every kernel that rotates: kiln's norm + RoPE kernel
(kiln/passes/kernels.py) and the Triton decode kernel's own rotation (kiln/attention/triton_kernels.py).

Why one helper with an explicit fused multiply-add: a decode rotates its new key inside the decode kernel while a
speculative verify, a prefill or a mixed step rotates in the norm + RoPE kernel, and the keys both write to the
cache are read by every later step, so the two must round alike. Written as `x cos - x' sin`, the compiler contracts
a multiply into an FMA where the product has one use and not where it has two (the decode kernel selects between
the halves' formulas over whole heads), so the same formula could round differently in two kernels. Here each
element is one rounded product and one FMA, whatever the surrounding code.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotate(x, signed_partner, cos, sin):
    """fp32 `x cos + signed_partner sin` with the second product rounded and the first fused: a first-half dim
    takes its second-half partner negated (x1 cos - x2 sin), a second-half dim its first-half partner (x2 cos +
    x1 sin)."""
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)  # a 16-bit cos / sin cache widens, as in the product before
    return tl.fma(x, cos, signed_partner * sin)
