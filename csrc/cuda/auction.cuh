// The eviction auction on the GPU (auction.cu): AuctionGpu::assign runs the floor auction and, when a lower bound
// is missed, the general one. The CPU counterpart is cpu/auction.h.
#pragma once

#include "cuda/auction_steps.cuh"
