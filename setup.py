"""The one thing pyproject.toml cannot say: skillstats._native, the C hot path (skillstats/_native.c)."""

from setuptools import Extension, setup

# optional: where it cannot be compiled (no gcc, no Python headers) the install still succeeds and
# skillstats runs its Python paths, the same counts, slower; the workers say so with a WARNING at start,
# and tests/test_native.py fails, so the README's commands and the image never ship without it.
setup(
    ext_modules=[
        Extension("skillstats._native", ["skillstats/_native.c"], extra_compile_args=["-O2"], optional=True),
    ]
)
