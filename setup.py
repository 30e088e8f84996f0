"""Builds the optional C fast path of the Kineto trace parser: analysis/parsers/_kscan.c (the event
scanner) and _kinflate.c (gzip inflation without the GIL; needs zlib's headers, zlib1g-dev).

Everything else is configured in pyproject.toml. Both extensions are optional: without a C compiler
the install still succeeds and analysis.parsers.kineto uses its pure-Python path, which gives the
same tables (tests/unit/test_kineto_fast.py checks that on every fixture), only slower.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("analysis.parsers._kscan", ["analysis/parsers/_kscan.c"], optional=True,
                             extra_compile_args=["-O3"]),
                   Extension("analysis.parsers._kinflate", ["analysis/parsers/_kinflate.c"], optional=True,
                             libraries=["z"], extra_compile_args=["-O3"])])
