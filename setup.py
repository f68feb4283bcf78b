"""Build hook for the optional native parts: the fused server-optimizer kernels and SecAgg+'s
one-pass quantization.

Everything else is declared in pyproject.toml. The extension is optional: without a C
compiler (or with TENSORSWAP_NO_EXT=1) the install goes on and tensorswap uses its numpy
kernels, which give bit-identical results, only slower (see docs/runs.md).
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: Bit-identical to the numpy kernels: no contraction into FMA, no fast-math.
UNIX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c99"]


class OptionalBuildExt(build_ext):
    """Build the extension if a compiler is there; warn and go on if not."""

    def build_extensions(self) -> None:
        if self.compiler.compiler_type == "unix":
            for ext in self.extensions:
                ext.extra_compile_args = [*UNIX_FLAGS, *ext.extra_compile_args]
        elif self.compiler.compiler_type == "msvc":
            for ext in self.extensions:
                ext.extra_compile_args = ["/O2", "/fp:precise", *ext.extra_compile_args]
        super().build_extensions()

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler, no headers: the numpy kernels serve instead
            self._skip(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(exc)

    @staticmethod
    def _skip(exc: BaseException) -> None:
        print(
            f"warning: tensorswap's fused kernels were not built ({exc}); "
            "the numpy kernels will be used (same results, slower)",
            file=sys.stderr,
        )


NATIVE = "src/tensorswap/_native"
"""Headers the extensions share."""

EXTENSIONS = (
    []
    if os.environ.get("TENSORSWAP_NO_EXT") == "1"
    else [
        Extension(
            "tensorswap.aggregate.server_opt._fused",
            sources=["src/tensorswap/aggregate/server_opt/_fused.c"],
            include_dirs=[NATIVE],
            depends=[f"{NATIVE}/widths.h"],
            optional=True,
        ),
        Extension(
            "tensorswap.privacy.secagg._quantize",
            sources=["src/tensorswap/privacy/secagg/_quantize.c"],
            include_dirs=[NATIVE],
            depends=[f"{NATIVE}/widths.h"],
            optional=True,
        ),
    ]
)

setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": OptionalBuildExt})
