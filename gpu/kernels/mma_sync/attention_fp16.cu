// fp16 instantiations of the attention kernels (one translation unit per dtype keeps nvcc runs parallel).
#include "gpu/kernels/mma_sync/attention_launch.cuh"

CPGOLD_MMA_SYNC_ENTRY_POINTS(fp16, __half)
