// Runs each kernel of kernels.cu on the host over the vectors written by
// `cargo run -p orchestrator-kernels --example kernel_vectors -- DIR` and compares with the CPU
// backend's bytes. Usage: harness DIR CASE...
#include "shim.h"
#include "../../kernels/src/cuda/kernels.cu"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

typedef std::vector<unsigned char> Bytes;

static Bytes read_file(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
static bool exists(const std::string& p) { std::ifstream f(p); return f.good(); }

static void grid(unsigned bx, unsigned by, unsigned threads) {
    gridDim.x = bx; gridDim.y = by; blockDim.x = threads; threadIdx.x = 0;
}

int main(int argc, char** argv) {
    if (argc < 3) { std::fprintf(stderr, "usage: harness DIR CASE...\n"); return 2; }
    int failures = 0;
    for (int a = 2; a < argc; ++a) {
        std::string dir = std::string(argv[1]) + "/" + argv[a];
        std::ifstream args(dir + "/args.txt");
        std::string kernel, line;
        std::getline(args, kernel);
        std::getline(args, line);
        std::istringstream ss(line);
        std::vector<u64> v;
        for (u64 x; ss >> x;) v.push_back(x);
        std::vector<Bytes> in, want, out;
        for (int i = 0; exists(dir + "/in" + std::to_string(i) + ".bin"); ++i) in.push_back(read_file(dir + "/in" + std::to_string(i) + ".bin"));
        for (int i = 0; exists(dir + "/out" + std::to_string(i) + ".bin"); ++i) want.push_back(read_file(dir + "/out" + std::to_string(i) + ".bin"));
        // Padding so 16-byte loads of the last rows stay inside the buffers.
        for (auto& b : in) b.resize(b.size() + 64);
        grid(1, 1, 1);
        blockIdx.x = blockIdx.y = 0;
        if (kernel == "gather_runs") {
            out = {Bytes(in[0].size() - 64)};
            gather_runs(in[0].data(), out[0].data(), (const u32*)in[1].data(), v[0], v[1], v[2]);
        } else if (kernel == "gather_runs_v16") {
            out = {Bytes(in[0].size() - 64)};
            gather_runs_v16((const uint4*)in[0].data(), (uint4*)out[0].data(), (const u32*)in[1].data(), v[0], v[1], v[2]);
        } else if (kernel == "expand_block_scales") {
            out = {Bytes(v[0] * v[1])};
            expand_block_scales(in[0].data(), out[0].data(), v[0], v[1], v[2], v[3], v[4]);
        } else if (kernel == "quantize_bf16") {
            out = {Bytes(v[0] * v[1]), Bytes(v[0] * v[1] / 32), Bytes(8, 0xFF)};
            quantize_bf16((const u16*)in[0].data(), out[0].data(), out[1].data(), v[0], v[1], (int)v[2], (int)v[3], (const u32*)in[1].data(),
                          (u64*)out[2].data());
        } else if (kernel == "swizzle_128x4") {
            out = {Bytes(v[2])};
            swizzle_128x4(in[0].data(), out[0].data(), v[0], v[1], v[2]);
        } else if (kernel == "unswizzle_128x4") {
            out = {Bytes(v[0] * v[1]), Bytes(4, 0)};
            unswizzle_128x4(in[0].data(), out[0].data(), v[0], v[1], v[2], (unsigned*)out[1].data());
        } else if (kernel == "pack_ue8m0" || kernel == "unpack_ue8m0") {
            out = {Bytes(in[0].size() - 64)};
            (kernel == "pack_ue8m0" ? pack_ue8m0 : unpack_ue8m0)((const u32*)in[0].data(), (u32*)out[0].data(), v[0], v[1], v[2]);
        } else if (kernel == "mx_gemm") {
            // Every tokens-per-thread variant must give the CPU's bytes; each writes its own copy.
            u64 t = v[0], n = v[1], k = v[2];
            typedef void (*Gemm)(const float*, u64, const u8*, const u8*, u64, u64, int, u64, u64, float*);
            const Gemm variants[] = {mx_gemm_t1, mx_gemm_t2, mx_gemm_t4, mx_gemm_t8};
            const u64 tokens[] = {1, 2, 4, 8};
            out.clear();
            for (int i = 0; i < 4; ++i) {
                out.push_back(Bytes(t * n * 4));
                grid((unsigned)n, (unsigned)((t + tokens[i] - 1) / tokens[i]), 1);
                for (unsigned by = 0; by < gridDim.y; ++by)
                    for (unsigned bx = 0; bx < gridDim.x; ++bx) {
                        blockIdx.x = bx; blockIdx.y = by;
                        variants[i]((const float*)in[0].data(), t, in[1].data(), in[2].data(), n, k, (int)v[3], v[4], v[5], (float*)out[i].data());
                    }
            }
            want = {want[0], want[0], want[0], want[0]};
            // A NaN is compared as a NaN, whatever its sign and payload: which NaN operand an
            // operation passes on differs between the variants (and from the CPU backend).
            for (auto* v : {&want, &out})
                for (auto& b : *v)
                    for (size_t f = 0; f + 4 <= b.size(); f += 4)
                        if (std::isnan(__uint_as_float(b[f] | b[f + 1] << 8 | b[f + 2] << 16 | (u32)b[f + 3] << 24))) {
                            b[f] = 0; b[f + 1] = 0; b[f + 2] = 0xC0; b[f + 3] = 0x7F;
                        }
        } else {
            std::fprintf(stderr, "%s: unknown kernel %s\n", argv[a], kernel.c_str());
            ++failures;
            continue;
        }
        bool ok = out.size() == want.size();
        for (size_t i = 0; ok && i < want.size(); ++i) {
            if (want[i].empty()) continue;  // not compared (an error case)
            if (want[i] != out[i]) {
                size_t at = 0;
                while (at < want[i].size() && at < out[i].size() && want[i][at] == out[i][at]) ++at;
                std::fprintf(stderr, "%s (%s): output %zu differs at byte %zu\n", argv[a], kernel.c_str(), i, at);
                ok = false;
            }
        }
        std::printf("%-20s %-20s %s\n", argv[a], kernel.c_str(), ok ? "ok" : "FAIL");
        failures += !ok;
    }
    return failures ? 1 : 0;
}
