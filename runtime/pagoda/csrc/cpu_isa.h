// Which instruction set a kernel build targets, from the compiler's own macros (pagoda/platform picks the
// flags: -march=native / -mcpu=native, or the forced level's own, -mavx2 -mfma ... or -march=armv8.2-a+bf16).
// Kernels include the per-ISA header for the highest level defined here instead of testing __AVX512BF16__,
// __ARM_FEATURE_BF16_VECTOR_ARITHMETIC & co. themselves.
#pragma once

// PAGODA_CPU_ISA=generic builds with -DPAGODA_ISA_GENERIC: no ISA-specific code even where the compiler's
// baseline has SIMD (NEON is part of every aarch64 target), so the generic kernels are what runs and is tested
#if !defined(PAGODA_ISA_GENERIC)
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_ISA_AVX512BF16 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_ISA_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PAGODA_ISA_AVX2 1
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define PAGODA_ISA_NEON 1
#endif
// BFDOT/BFMMLA (the BF16 extension: -march=...+bf16, or -mcpu=native on Graviton3/4, Apple M2 on)
#if defined(PAGODA_ISA_NEON) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#define PAGODA_ISA_NEONBF16 1
#endif
#endif  // PAGODA_ISA_GENERIC

namespace pagoda {

// the level this translation unit was compiled for, as pagoda.platform names it
constexpr const char* kIsaLevel =
#if defined(PAGODA_ISA_AVX512BF16)
    "avx512bf16";
#elif defined(PAGODA_ISA_AVX512)
    "avx512";
#elif defined(PAGODA_ISA_AVX2)
    "avx2";
#elif defined(PAGODA_ISA_NEONBF16)
    "neonbf16";
#elif defined(PAGODA_ISA_NEON)
    "neon";
#else
    "generic";
#endif

}  // namespace pagoda
