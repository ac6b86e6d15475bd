"""Build hook for the optional C extension ``router._speedups`` (hashing and lookup hot loops).

Everything else about the package is in pyproject.toml. ``optional=True``: without a C compiler
or Python headers the install still succeeds and ``router.block_hashing`` and
``router.prefix_index`` use their pure-Python twins, which give the same results, only slower
(``block_hashing.HASHING`` says which one runs; tests/test_prefix_index.py fails while the
extension is not built, so a CI without it shows).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("router._speedups", sources=["router/_speedups.c"], optional=True),
    ]
)
