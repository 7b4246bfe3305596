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
			/* four 16-byte loads in flight per thread */
			for (; i + 3 * blockDim.x < n4; i += 4 * blockDim.x) {
				uint4 a = p4[i], b = p4[i + blockDim.x], c = p4[i + 2 * blockDim.x],
				      e = p4[i + 3 * blockDim.x];
				d4[i] = a;
				d4[i + blockDim.x] = b;
				d4[i + 2 * blockDim.x] = c;
				d4[i + 3 * blockDim.x] = e;
			}
			for (; i < n4; i += blockDim.x)
				d4[i] = p4[i];
		} else {
			for (unsigned long long i = threadIdx.x; i < len; i += blockDim.x)
				d[i] = p[i];
		}
	}
}
