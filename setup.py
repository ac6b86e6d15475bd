"""Build hook for the optional C extension ``kvroute.kvcore._speedups`` (hashing, lookup loops).

Everything else about the package is in pyproject.toml. ``optional=True``: without a C compiler
or Python headers the install still succeeds and ``kvcore.block_hashing`` and
``kvcore.prefix_index`` use their pure-Python twins, which give the same results, only slower
(``block_hashing.use_speedups()`` says which one runs; tests/test_prefix_index.py fails while
the extension is not built, so a CI without it shows).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvroute.kvcore._speedups", sources=["kvcore/_speedups.c"], optional=True),
    ]
)
