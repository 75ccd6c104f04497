// An aten argument (IValue) as the Python object torch makes of it: torch::jit::toPyObject,
// declared here rather than through torch/csrc/jit/python/pybind_utils.h, whose include tree
// (the whole TorchScript IR) cost most of the observer's build time. The function itself is
// libtorch_python's, so the objects are exactly torch's.
#include <ATen/core/ivalue.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Export.h>

namespace torch::jit {
TORCH_PYTHON_API pybind11::object toPyObject(c10::IValue ivalue);
}  // namespace torch::jit

#include "observer.h"

namespace copytrace {

// A new reference, or null with a Python error set.
PyObject* ivalue_to_py(const c10::IValue& value) {
  try {
    return torch::jit::toPyObject(value).release().ptr();
  } catch (pybind11::error_already_set& err) {
    err.restore();
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
  return nullptr;
}

}  // namespace copytrace
