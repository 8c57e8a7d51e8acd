"""Builds the stage engine's capture hook (native/capture.c) with the package.

The extension is optional: if no C compiler is available the package still installs, and the
engine falls back to a Python capture callback with a warning.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshagent.engine._capture",
            sources=["native/capture.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
