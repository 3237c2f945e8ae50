// DDMA planner core (reference: megarl/ddma/plan.py)

#include <torch/extension.h>

void register_plan(pybind11::module_& m) { (void)m; }
