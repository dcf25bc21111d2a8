"""monim: a kNN-LM whose memory learns what to memorize from a daily news stream (MoNIM)."""

import os

# PyTorch's OpenMP threads spin-wait by default: with 2 threads on a busy 2-core machine that makes
# it 4-5x slower. The setting only takes effect if made before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
