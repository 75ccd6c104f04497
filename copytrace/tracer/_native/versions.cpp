// Version counters of fresh copies (copytrace/tracer/_fresh.py).
//
// A fresh copy's in-place writes are how far its version counter advanced while it lived. The
// counter (c10::VariableVersion) is shared by a tensor and all its views and is bumped by every
// in-place op, out= included. version_of(tensor) returns a small object holding the counter (a
// refcounted VersionCounter: it keeps neither the tensor nor its storage alive) and its value
// now; version_delta(that object) is how far it advanced since, readable after the tensor died,
// and version_final(that object) the same once no tensor shares the counter any more.
// version_of gives None for what has no counter (inference tensors, non-tensors).
//
// grad_fn_ref(tensor) returns a small object holding a weak pointer on the tensor's grad_fn
// (the attached copies of copytrace/tracer/watch/_watch.py): nothing on the tensor (no Python
// weak reference, which torch.utils.swap_tensors refuses; no weak count on its TensorImpl) and
// nothing visible on the node (which Python cannot weakly reference). grad_fn_of(that object)
// is the node as Python sees it (tensor.grad_fn: torch's functionToPyObject) while it lives,
// else None; grad_fn_alive(that object) tells the same without making the Python object.
// grad_fn_ref(node) makes the same weak pointer from a node as Python sees it (a C++ node's
// THPCppFunction, e.g. ToCopyBackward0: copytrace/tracer/_node_tags.py); None for a Python
// Function's node.
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
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

// The strong pointer a tensor's grad_fn() returns (std::shared_ptr up to torch 2.12,
// c10::intrusive_ptr since) and its weak form.
using NodePtr = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;
template <class P>
struct WeakOf;
template <class T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <class T>
struct WeakOf<c10::intrusive_ptr<T>> {
  using type = c10::weak_intrusive_ptr<T>;
};
using NodeWeak = typename WeakOf<NodePtr>::type;

struct NodeRef {
  PyObject_HEAD
  NodeWeak node;  // constructed in place by grad_fn_ref
};

void node_dealloc(PyObject* self) {
  reinterpret_cast<NodeRef*>(self)->node.~NodeWeak();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyType_Slot g_node_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&node_dealloc)},
    {Py_tp_doc, const_cast<char*>("a weak pointer on a tensor's grad_fn")},
    {0, nullptr}};
PyType_Spec g_node_spec = {"copytrace_observer.NodeRef", sizeof(NodeRef), 0, Py_TPFLAGS_DEFAULT,
                           g_node_slots};
PyTypeObject* g_node_type = nullptr;

NodeRef* node_ref(PyObject* obj, const char* what) {
  if (g_node_type == nullptr || Py_TYPE(obj) != g_node_type) {
    PyErr_Format(PyExc_TypeError, "%s() takes what grad_fn_ref() returned", what);
    return nullptr;
  }
  return reinterpret_cast<NodeRef*>(obj);
}

}  // namespace

PyObject* py_grad_fn_ref(PyObject*, PyObject* obj) {
  if (g_node_type == nullptr) Py_RETURN_NONE;
  if (torch::autograd::THPCppFunction_Check(obj)) {  // a node
    const auto& fn = reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata;
    if (!fn) Py_RETURN_NONE;
    PyObject* self = PyType_GenericAlloc(g_node_type, 0);
    if (self == nullptr) return nullptr;
    new (&reinterpret_cast<NodeRef*>(self)->node) NodeWeak(fn);
    return self;
  }
  if (!THPVariable_Check(obj)) Py_RETURN_NONE;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined()) Py_RETURN_NONE;
    const NodePtr& fn = t.grad_fn();
    if (!fn) Py_RETURN_NONE;
    PyObject* self = PyType_GenericAlloc(g_node_type, 0);
    if (self == nullptr) return nullptr;
    new (&reinterpret_cast<NodeRef*>(self)->node) NodeWeak(fn);
    return self;
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
}

bool node_facts(PyObject* node, long long* seq, PyObject** leaf_version) {
  if (!torch::autograd::THPCppFunction_Check(node)) return false;
  const auto& fn = reinterpret_cast<torch::autograd::THPCppFunction*>(node)->cdata;
  if (!fn) return false;
  PyObject* version = nullptr;
  try {
    // node.next_functions[0][0].variable._version: the leaf an AccumulateGrad holds
    const auto* acc = fn->num_outputs() > 0 ? dynamic_cast<const torch::autograd::AccumulateGrad*>(
                                                  fn->next_edge(0).function.get())
                                            : nullptr;
    if (acc != nullptr && acc->variable.defined())
      version = PyLong_FromLongLong(acc->variable._version());
  } catch (const std::exception&) {  // an inference tensor: no version counter
    version = nullptr;
  }
  if (version == nullptr) {
    if (PyErr_Occurred()) return false;
    version = Py_NewRef(Py_None);
  }
  *seq = static_cast<long long>(fn->sequence_nr());
  *leaf_version = version;
  return true;
}

PyObject* py_grad_fn_of(PyObject*, PyObject* obj) {
  NodeRef* ref = node_ref(obj, "grad_fn_of");
  if (ref == nullptr) return nullptr;
  NodePtr fn = ref->node.lock();
  if (!fn) Py_RETURN_NONE;
  try {
    return torch::autograd::functionToPyObject(fn);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* py_grad_fn_alive(PyObject*, PyObject* obj) {
  NodeRef* ref = node_ref(obj, "grad_fn_alive");
  if (ref == nullptr) return nullptr;
  return PyBool_FromLong(!ref->node.expired());
}

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

// The pair (a, b), untracked by the cycle collector when neither item is tracked (a VersionRef
// is no GC type, a record is untracked at birth: copy_slots). CPython untracks such a tuple
// itself only when each item is an untracked tuple or no GC type: a record, an instance of a
// class, keeps its (version, record) pair tracked, so each pair that outlived two young
// collections was promoted to the oldest generation and counted towards its next full
// collection, which walks the whole heap (about one per 125k kept copies, 0.2 s each). No
// cycle can run through the pair that the collector could see: its items are not traversed.
PyObject* kept_pair(PyObject* a, PyObject* b) {
  PyObject* pair = PyTuple_Pack(2, a, b);
  if (pair != nullptr && !PyObject_GC_IsTracked(a) && !PyObject_GC_IsTracked(b))
    PyObject_GC_UnTrack(pair);
  return pair;
}

PyObject* py_kept_pair(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "kept_pair(a, b) takes 2 arguments");
    return nullptr;
  }
  return kept_pair(args[0], args[1]);
}

bool versions_init(PyObject* module) {
  if (g_version_type == nullptr) {
    g_version_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&g_version_spec));
    if (g_version_type == nullptr) return false;
  }
  if (g_node_type == nullptr) {
    g_node_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&g_node_spec));
    if (g_node_type == nullptr) return false;
  }
  return PyModule_AddObjectRef(module, "VersionRef",
                               reinterpret_cast<PyObject*>(g_version_type)) == 0 &&
         PyModule_AddObjectRef(module, "NodeRef", reinterpret_cast<PyObject*>(g_node_type)) == 0;
}

}  // namespace copytrace
