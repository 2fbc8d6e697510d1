"""The one thing pyproject.toml cannot say: skillstats._native, the C hot path (skillstats/_native.c)."""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "skillstats/_native.c"
# The source's hash, built into the module: skillstats.contract leaves a module built from another source than the
# _native.c beside it unused (an editable checkout pulled without reinstalling; an installed package, which ships
# the source as package data), where it would judge by yesterday's code.
SOURCE_SHA256 = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

# optional: where it cannot be compiled (no gcc, no Python headers) the install still succeeds and
# skillstats runs its Python paths, the same counts, slower; the workers say so with a WARNING at start,
# and tests/test_native.py fails, so the README's commands and the image never ship without it.
setup(
    ext_modules=[
        Extension(
            "skillstats._native",
            [SOURCE],
            define_macros=[("SOURCE_SHA256", f'"{SOURCE_SHA256}"')],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
