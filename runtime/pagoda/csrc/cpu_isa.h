// Which instruction set a kernel build targets, from the compiler's own macros (pagoda/platform picks the
// flags: -march=native, or a level's -mavx2 -mfma ... when PAGODA_CPU_ISA forces one). Kernels include the
// per-ISA header for the highest level defined here instead of testing __AVX512BF16__ & co. themselves.
#pragma once

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

namespace pagoda {

// the level this translation unit was compiled for, as pagoda.platform names it
constexpr const char* kIsaLevel =
#if defined(PAGODA_ISA_AVX512BF16)
    "avx512bf16";
#elif defined(PAGODA_ISA_AVX512)
    "avx512";
#elif defined(PAGODA_ISA_AVX2)
    "avx2";
#elif defined(PAGODA_ISA_NEON)
    "neon";
#else
    "generic";
#endif

}  // namespace pagoda
