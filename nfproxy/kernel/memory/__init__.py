"""In-memory kernels with the Kernel interface (kernel/base.py): for tests and tools that need
a kernel's semantics without root. `last` is the last payload applied."""
