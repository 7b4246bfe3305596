// Gather/scatter copy kernel of the CUDA copy engine: copies a list of
// (dst, src, len) segments. Either side may be device memory (an imported
// KV cache) or mapped pinned host memory (the L1 arena): one kernel writes
// straight into host memory over PCIe, so small blocks do not pay one DMA
// setup each. Compiled to PTX at build time, loaded with cuModuleLoadData.
struct kvs_seg {
	unsigned long long dst, src, len;
};

extern "C" __global__ void kvs_copy_segs(const kvs_seg *segs, unsigned n)
{
	for (unsigned s = blockIdx.x; s < n; s += gridDim.x) {
		char *d = (char *)segs[s].dst;
		const char *p = (const char *)segs[s].src;
		unsigned long long len = segs[s].len;
		if ((((unsigned long long)d | (unsigned long long)p | len) & 15) == 0) {
			uint4 *d4 = (uint4 *)d;
			const uint4 *p4 = (const uint4 *)p;
			unsigned long long n4 = len >> 4;
			unsigned long long i = threadIdx.x;
			/* eight 16-byte loads in flight per thread: reads of mapped
			 * host memory (retrieve) cross PCIe and need many outstanding
			 * requests to fill the link */
			const unsigned long long B = blockDim.x;
			for (; i + 7 * B < n4; i += 8 * B) {
				uint4 v0 = p4[i], v1 = p4[i + B], v2 = p4[i + 2 * B], v3 = p4[i + 3 * B];
				uint4 v4 = p4[i + 4 * B], v5 = p4[i + 5 * B], v6 = p4[i + 6 * B], v7 = p4[i + 7 * B];
				d4[i] = v0;
				d4[i + B] = v1;
				d4[i + 2 * B] = v2;
				d4[i + 3 * B] = v3;
				d4[i + 4 * B] = v4;
				d4[i + 5 * B] = v5;
				d4[i + 6 * B] = v6;
				d4[i + 7 * B] = v7;
			}
			for (; i + 3 * B < n4; i += 4 * B) {
				uint4 v0 = p4[i], v1 = p4[i + B], v2 = p4[i + 2 * B], v3 = p4[i + 3 * B];
				d4[i] = v0;
				d4[i + B] = v1;
				d4[i + 2 * B] = v2;
				d4[i + 3 * B] = v3;
			}
			for (; i < n4; i += B)
				d4[i] = p4[i];
		} else {
			for (unsigned long long i = threadIdx.x; i < len; i += blockDim.x)
				d[i] = p[i];
		}
	}
}

// Test hook (KVS_TEST_CUDA_HOLD_MS, copy_cuda.c): holds the stream it runs on
// for ns nanoseconds of the GPU's global timer, so the copies queued behind it
// land late (the GPU suite's test_gpu_late). Never launched otherwise.
extern "C" __global__ void kvs_test_hold(unsigned long long ns)
{
	unsigned long long t0, t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
	do
		asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	while (t - t0 < ns);
}
