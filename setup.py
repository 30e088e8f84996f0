"""Builds the optional C fast path of the Kineto trace parser: analysis/parsers/_kscan.c (the event scanner, and the
row selections, time bounds, step assignment and interval sweeps the analyses run on its tables).

Everything else is configured in pyproject.toml. The extension is optional: without a C compiler the install still
succeeds and analysis.parsers.kineto uses its pure-Python path, which gives the same tables
(tests/unit/test_kineto_fast.py checks that on every fixture), only slower.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("analysis.parsers._kscan", ["analysis/parsers/_kscan.c"], optional=True,
                             extra_compile_args=["-O3"])])
