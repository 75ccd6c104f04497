// The legacy constructors of a list of tensors (copytrace/tracer/_legacy.py).
//
// torch.Tensor([a, b]) runs TensorBase's tp_new (THPVariable_pynew) and torch.FloatTensor([a, b])
// its type object's (legacy_new_from_sequence, torch/csrc/utils/tensor_new.cpp): no function mode
// sees either. While tracing, legacy_install stores a trampoline in the tp_new slot of
// TensorBase, of every subclass that holds TensorBase's pointer (torch.Tensor and the classes
// that inherit it: TensorBase.__new__, CPython's tp_new_wrapper, refuses a subtype whose nearest
// tp_new that is not slot_tp_new differs from TensorBase's own, "is not safe") and of each legacy
// type object. A trampoline calls the original straight away unless the call is on the traced
// thread, of exactly one positional list or tuple, outside a recorded call, with torch function
// handling on, and (tensor_tp_new) of torch.Tensor itself: a subclass's S(...) stays torch's.
// Such a call goes to call_op_recorded (api_mode.cpp) as op `op` with (cls, data): api_before
// lets it through unless the data holds a tensor, and g_callable runs the original tp_new.
// legacy_restore puts the originals back wherever a trampoline is, in subclasses made while
// tracing too (they inherited it). Each swap is one aligned pointer store with the GIL held; no
// attribute changes, so no type cache is flushed. Python only, with ATen's torch-function TLS
// header for the disabled state (observer.h).
#define COPYTRACE_TORCH_TLS
#include "observer.h"

namespace copytrace {
namespace {

newfunc g_tensor_orig = nullptr;  // TensorBase's tp_new
newfunc g_typed_orig = nullptr;   // the legacy type objects' tp_new (one for all)
PyTypeObject* g_tensor_base = nullptr;  // owned
PyTypeObject* g_tensor = nullptr;       // torch.Tensor, owned
PyObject* g_op = nullptr;               // the op name, owned
PyObject* g_callable = nullptr;         // legacy_call as a builtin, owned
std::atomic<unsigned long> g_thread{0};  // the traced thread while installed, else 0

inline bool records(PyObject* args) {
  if (g_thread.load(std::memory_order_relaxed) != PyThread_get_thread_ident()) return false;
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 1) return false;
  PyObject* data = PyTuple_GET_ITEM(args, 0);
  if (!PyList_Check(data) && !PyTuple_Check(data)) return false;
  return !tls_folding && tls_suppress == 0 && g_table != nullptr && g_op != nullptr &&
         at::impl::PythonTorchFunctionTLS::get_disabled_state() !=
             at::impl::TorchFunctionDisabledState::ALL_DISABLED;
}

PyObject* record(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* full = PyTuple_Pack(2, reinterpret_cast<PyObject*>(type), PyTuple_GET_ITEM(args, 0));
  if (full == nullptr) return nullptr;
  PyObject* r = call_op_recorded(g_op, g_callable, full, kwargs, true);
  Py_DECREF(full);
  return r;
}

PyObject* tensor_tp_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (type == g_tensor && records(args)) return record(type, args, kwargs);
  return g_tensor_orig(type, args, kwargs);
}

PyObject* typed_tp_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (records(args)) return record(type, args, kwargs);
  return g_typed_orig(type, args, kwargs);
}

// g_callable((cls, *args), kwargs): the original tp_new of cls, as the trampoline would call it
PyObject* legacy_call(PyObject*, PyObject* args, PyObject* kwargs) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1 ||
      !PyType_Check(PyTuple_GET_ITEM(args, 0)) || g_tensor_base == nullptr) {
    PyErr_SetString(PyExc_TypeError, "legacy_call(cls, *args, **kwargs)");
    return nullptr;
  }
  auto* type = reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(args, 0));
  const newfunc orig = PyType_IsSubtype(type, g_tensor_base) ? g_tensor_orig : g_typed_orig;
  if (orig == nullptr) {
    PyErr_SetString(PyExc_TypeError, "legacy_call: no original tp_new");
    return nullptr;
  }
  PyObject* rest = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
  if (rest == nullptr) return nullptr;
  PyObject* r = orig(type, rest, kwargs);
  Py_DECREF(rest);
  return r;
}

PyMethodDef g_call_def = {"legacy_call", reinterpret_cast<PyCFunction>(
                              reinterpret_cast<void (*)()>(&legacy_call)),
                          METH_VARARGS | METH_KEYWORDS,
                          "a legacy constructor's original tp_new (see legacy.cpp)"};

inline int swap(PyTypeObject* t, newfunc from, newfunc to) {
  if (from == nullptr || t->tp_new != from) return 0;
  __atomic_store_n(&t->tp_new, to, __ATOMIC_RELEASE);
  return 1;
}

// f(t) for root and every class below it (type.__subclasses__, depth-first)
template <typename F>
void each_subclass(PyTypeObject* root, F& f, int depth) {
  f(root);
  if (depth > 64) return;
  PyObject* subs = PyObject_CallMethod(reinterpret_cast<PyObject*>(&PyType_Type),
                                       "__subclasses__", "O", root);
  if (subs == nullptr || !PyList_Check(subs)) {
    Py_XDECREF(subs);
    PyErr_Clear();
    return;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(subs); ++i) {
    PyObject* sub = PyList_GET_ITEM(subs, i);
    if (PyType_Check(sub)) each_subclass(reinterpret_cast<PyTypeObject*>(sub), f, depth + 1);
  }
  Py_DECREF(subs);
}

bool types_of(PyObject* base, PyObject* typed) {
  if (!PyType_Check(base) || !PyTuple_Check(typed)) {
    PyErr_SetString(PyExc_TypeError, "a type and a tuple of types expected");
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(typed); ++i) {
    if (!PyType_Check(PyTuple_GET_ITEM(typed, i))) {
      PyErr_SetString(PyExc_TypeError, "a tuple of types expected");
      return false;
    }
  }
  return true;
}

}  // namespace

// legacy_install(op, TensorBase, Tensor, typed) -> how many tp_new slots now hold a trampoline
PyObject* py_legacy_install(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "legacy_install(op, base, tensor, typed)")) return nullptr;
  if (!PyUnicode_Check(argv[0]) || !PyType_Check(argv[2]) || !types_of(argv[1], argv[3])) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "legacy_install(op, base, tensor, typed)");
    return nullptr;
  }
  auto* base = reinterpret_cast<PyTypeObject*>(argv[1]);
  if (g_tensor_orig == nullptr && base->tp_new != tensor_tp_new) g_tensor_orig = base->tp_new;
  const Py_ssize_t n = PyTuple_GET_SIZE(argv[3]);
  for (Py_ssize_t i = 0; i < n && g_typed_orig == nullptr; ++i) {
    auto* t = reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(argv[3], i));
    if (t->tp_new != typed_tp_new) g_typed_orig = t->tp_new;
  }
  if (g_callable == nullptr) {
    g_callable = PyCFunction_NewEx(&g_call_def, nullptr, nullptr);
    if (g_callable == nullptr) return nullptr;
  }
  set_slot(g_op, argv[0]);
  set_slot(reinterpret_cast<PyObject*&>(g_tensor_base), argv[1]);
  set_slot(reinterpret_cast<PyObject*&>(g_tensor), argv[2]);
  long count = 0;
  auto to_trampoline = [&count](PyTypeObject* t) { count += swap(t, g_tensor_orig, tensor_tp_new); };
  each_subclass(base, to_trampoline, 0);
  for (Py_ssize_t i = 0; i < n; ++i)
    count += swap(reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(argv[3], i)), g_typed_orig,
                  typed_tp_new);
  g_thread.store(PyThread_get_thread_ident());
  return PyLong_FromLong(count);
}

// legacy_restore(TensorBase, typed) -> how many tp_new slots were given their original back
PyObject* py_legacy_restore(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "legacy_restore(base, typed)")) return nullptr;
  if (!types_of(argv[0], argv[1])) return nullptr;
  g_thread.store(0);
  long count = 0;
  auto to_original = [&count](PyTypeObject* t) { count += swap(t, tensor_tp_new, g_tensor_orig); };
  each_subclass(reinterpret_cast<PyTypeObject*>(argv[0]), to_original, 0);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(argv[1]); ++i)
    count += swap(reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(argv[1], i)), typed_tp_new,
                  g_typed_orig);
  return PyLong_FromLong(count);
}

}  // namespace copytrace
