"""GPU kernels (TileLang, Triton). Imported lazily by the backends that use them."""
