// The bfloat16 matmul micro-kernel of the ISA level the library is compiled for, as bf16_matmul::isa: its
// rows_against_block(BlockTask, y), kWantsFloatX and kFloatXRows. For the sources that run packed blocks
// themselves (layers/bf16_matmul_cpu.cpp, lora/lora_cpu.cpp).
#pragma once

#include "cpu_isa.h"

#if defined(PAGODA_ISA_AVX512BF16)
#include "bf16_matmul_avx512bf16.h"
namespace pagoda::bf16_matmul { namespace isa = avx512bf16; }
#elif defined(PAGODA_ISA_AVX2)
#include "bf16_matmul_avx2.h"
namespace pagoda::bf16_matmul { namespace isa = avx2; }
#elif defined(PAGODA_ISA_NEONBF16)
#include "bf16_matmul_neonbf16.h"
namespace pagoda::bf16_matmul { namespace isa = neonbf16; }
#elif defined(PAGODA_ISA_NEON)
#include "bf16_matmul_neon.h"
namespace pagoda::bf16_matmul { namespace isa = neon; }
#else
#include "bf16_matmul_generic.h"
namespace pagoda::bf16_matmul { namespace isa = generic; }
#endif
