// Version counters of fresh copies (copytrace/tracer/_fresh.py).
//
// A fresh copy's in-place writes are how far its version counter advanced while it lived. The
// counter (c10::VariableVersion) is shared by a tensor and all its views and is bumped by every
// in-place op, out= included. version_of(tensor) returns a small object holding the counter (a
// refcounted VersionCounter: it keeps neither the tensor nor its storage alive) and its value
// now; version_delta(that object) is how far it advanced since, readable after the tensor died,
// and version_final(that object) the same once no tensor shares the counter any more.
// version_of gives None for what has no counter (inference tensors, non-tensors).
#include <torch/csrc/autograd/python_variable.h>

#include "observer.h"

namespace copytrace {
namespace {

struct VersionRef {
  PyObject_HEAD
  c10::VariableVersion counter;  // constructed in place by version_of
  uint32_t start;
};

void version_dealloc(PyObject* self) {
  reinterpret_cast<VersionRef*>(self)->counter.~VariableVersion();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyType_Slot g_version_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&version_dealloc)},
    {Py_tp_doc, const_cast<char*>("a tensor's version counter and its value when read")},
    {0, nullptr}};
PyType_Spec g_version_spec = {"copytrace_observer.VersionRef", sizeof(VersionRef), 0,
                              Py_TPFLAGS_DEFAULT, g_version_slots};
PyTypeObject* g_version_type = nullptr;

VersionRef* version_ref(PyObject* obj, const char* what) {
  if (g_version_type == nullptr || Py_TYPE(obj) != g_version_type) {
    PyErr_Format(PyExc_TypeError, "%s() takes what version_of() returned", what);
    return nullptr;
  }
  return reinterpret_cast<VersionRef*>(obj);
}

}  // namespace

PyObject* version_of(PyObject*, PyObject* obj) {
  if (g_version_type == nullptr || !THPVariable_Check(obj)) Py_RETURN_NONE;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined()) Py_RETURN_NONE;
    const c10::VariableVersion& counter = t.unsafeGetTensorImpl()->version_counter();
    if (!counter.enabled()) Py_RETURN_NONE;  // an inference tensor
    const uint32_t start = counter.current_version();
    PyObject* self = PyType_GenericAlloc(g_version_type, 0);
    if (self == nullptr) return nullptr;
    auto* ref = reinterpret_cast<VersionRef*>(self);
    new (&ref->counter) c10::VariableVersion(counter);
    ref->start = start;
    return self;
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
}

PyObject* py_version_delta(PyObject*, PyObject* obj) {
  VersionRef* ref = version_ref(obj, "version_delta");
  if (ref == nullptr) return nullptr;
  const uint32_t now = ref->counter.current_version();
  return PyLong_FromUnsignedLong(static_cast<uint32_t>(now - ref->start));
}

// the delta once no tensor shares the counter any more (the copy and all its views are gone:
// this handle holds the only reference), else None
PyObject* py_version_final(PyObject*, PyObject* obj) {
  VersionRef* ref = version_ref(obj, "version_final");
  if (ref == nullptr) return nullptr;
  if (!ref->counter.unique()) Py_RETURN_NONE;
  const uint32_t now = ref->counter.current_version();
  return PyLong_FromUnsignedLong(static_cast<uint32_t>(now - ref->start));
}

bool versions_init(PyObject* module) {
  if (g_version_type == nullptr) {
    g_version_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&g_version_spec));
    if (g_version_type == nullptr) return false;
  }
  return PyModule_AddObjectRef(module, "VersionRef",
                               reinterpret_cast<PyObject*>(g_version_type)) == 0;
}

}  // namespace copytrace
