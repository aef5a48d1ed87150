/*
 * Torch op `torch.ops.lmcache_platforms_ascend.transfer` around the Ascend C kernel, queued through
 * torch_npu's OpCommand so it runs in order with the other work torch_npu has queued on the current stream.
 * Loaded with torch.ops.load_library by lmcache_platforms/kernels/ascend_backend.py.
 */
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "acl/acl.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include "../lmcp_plane_table.h"

#ifndef LMCP_ALIGNMENT
#define LMCP_ALIGNMENT 1
#endif

extern "C" void lmcp_kv_transfer_launch(uint32_t block_dim, void *stream, void *table, void *slots, void *buffer,
                                        int64_t num_planes, int64_t num_rows, int64_t slots_plane_stride,
                                        int64_t store);

namespace {

int64_t vector_cores()
{
    int32_t device = 0;
    TORCH_CHECK(aclrtGetDevice(&device) == ACL_SUCCESS, "lmcache_platforms ascend: aclrtGetDevice failed");
    int64_t cores = 0;
    if (aclGetDeviceCapability(device, ACL_DEVICE_INFO_VECTOR_CORE_NUM, &cores) != ACL_SUCCESS || cores <= 0) {
        TORCH_CHECK(aclGetDeviceCapability(device, ACL_DEVICE_INFO_AI_CORE_NUM, &cores) == ACL_SUCCESS && cores > 0,
                    "lmcache_platforms ascend: cannot read the core count of device ", device);
    }
    return cores;
}

void transfer(const at::Tensor &table, const at::Tensor &slots, const at::Tensor &buffer, int64_t slots_plane_stride,
              bool store)
{
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == LMCP_PLANE_FIELDS &&
                    table.is_contiguous(),
                "lmcache_platforms ascend: table must be a contiguous int64 [P, ", LMCP_PLANE_FIELDS, "] tensor");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(),
                "lmcache_platforms ascend: slots must be contiguous int64");
    TORCH_CHECK(buffer.is_contiguous(), "lmcache_platforms ascend: the chunk buffer must be contiguous");
    TORCH_CHECK(table.device() == buffer.device() && slots.device() == buffer.device(),
                "lmcache_platforms ascend: table, slots and buffer must be on one NPU");
    const int64_t planes = table.size(0);
    const int64_t rows = slots.size(-1);
    if (planes == 0 || rows == 0) {
        return;
    }
    const uint32_t block_dim = static_cast<uint32_t>(std::min<int64_t>(vector_cores(), planes * rows));
    void *table_ptr = table.data_ptr();
    void *slots_ptr = slots.data_ptr();
    void *buffer_ptr = buffer.data_ptr();
    aclrtStream stream = c10_npu::getCurrentNPUStream().stream();
    at_npu::native::OpCommand cmd;
    cmd.Name("lmcp_kv_transfer");
    cmd.SetCustomHandler([=]() -> int {
        lmcp_kv_transfer_launch(block_dim, stream, table_ptr, slots_ptr, buffer_ptr, planes, rows,
                                slots_plane_stride, store ? 1 : 0);
        return 0;
    });
    cmd.Run();
}

int64_t abi_version() { return LMCP_ABI_VERSION; }

// Byte granularity every address, stride and size must have (32 on 310P builds, 1 elsewhere).
int64_t alignment() { return LMCP_ALIGNMENT; }

}  // namespace

TORCH_LIBRARY(lmcache_platforms_ascend, m)
{
    m.def("transfer(Tensor table, Tensor slots, Tensor(a!) buffer, int slots_plane_stride, bool store) -> ()");
    m.def("abi_version() -> int", &abi_version);
    m.def("alignment() -> int", &alignment);
}

TORCH_LIBRARY_IMPL(lmcache_platforms_ascend, PrivateUse1, m) { m.impl("transfer", &transfer); }
