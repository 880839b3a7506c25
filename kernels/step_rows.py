"""The widest step the decode kernels serve: a verify block of drafted rows. The streaming GEMV, the
MoE decode layout, the Triton routing and the engine's graphed step widths all take their limit
from here, so raising it cannot leave one of them on a slower path unnoticed."""

DECODE_STEP_ROWS = 16
