/* WIDTHS: compile a loop once per vector width, the CPU choosing at load time (GCC/clang on
 * x86-64 with an ifunc-capable libc); elsewhere the compiler's default target. The widths
 * change the speed only: each lane does the same correctly rounded IEEE operations. Shared by
 * tensorswap's optional C kernels (setup.py puts this directory on their include path). */
#ifndef TENSORSWAP_WIDTHS_H
#define TENSORSWAP_WIDTHS_H
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones) && defined(__linux__)
#define WIDTHS __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef WIDTHS
#define WIDTHS
#endif
#endif
