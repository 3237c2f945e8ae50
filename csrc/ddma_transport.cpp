// DDMA same-host zero-copy reads (process_vm_readv)

#include <torch/extension.h>

void register_ddma_transport(pybind11::module_& m) { (void)m; }
