// Level "lean": the copying API wrapped in C, no TorchFunctionMode.
//
// Instead of a mode that sees every torch call, each callable of the API table (Tensor.clone,
// torch.clone, Tensor.to, ...) is recorded by a C function exactly as the mode's handler does
// (call_through_recorded, api_mode.cpp): torch's own pointers are hot-patched (hotpatch.cpp),
// and the few callables with no C pointer (Tensor.__deepcopy__, Tensor.backward,
// Tensor.__getitem__) are replaced as attributes (wrap_api; data_descriptor for Tensor.data
// where its getset cannot be patched). A C function adds no Python frame; every other torch
// call runs untouched. Off the traced thread, outside tracing and inside a recorded call they
// call the original straight away.
#include <deque>
#include <string>
#include <unordered_set>

#define COPYTRACE_TORCH_TLS
#include "observer.h"

namespace copytrace {

std::atomic<bool> g_wrappers_on{false};
PyObject* g_data_get = nullptr;
PyObject* g_data_set = nullptr;

namespace {

std::deque<PyMethodDef> g_wrap_defs;  // one per wrapper (its name); never freed
std::deque<std::string> g_wrap_names;

// Code objects of torch's Python-level functions that a TorchFunctionMode sees as one call
// (they dispatch through handle_torch_function: torch.nn.functional's, Tensor.__repr__...).
// A mode's handler runs them with the mode off the stack, so it sees none of the torch calls
// they make; the wrappers stay quiet inside them too (their aten copies are implicit ones).
PyObject* g_quiet_codes = nullptr;  // a set

PyObject* api_wrapper(PyObject* orig, PyObject* args, PyObject* kwargs) {
  if (!wrappers_record()) return PyObject_Call(orig, args, kwargs);
  return call_through_recorded(orig, args, kwargs, true);
}

struct DataDescr {
  PyObject_HEAD
  PyObject* orig;  // the original `data` getset descriptor of torch._C.TensorBase
};

PyObject* data_get(PyObject* self, PyObject* obj, PyObject* type) {
  PyObject* orig = reinterpret_cast<DataDescr*>(self)->orig;
  if (obj == nullptr || obj == Py_None || !wrappers_record() || g_data_get == nullptr)
    return Py_TYPE(orig)->tp_descr_get(orig, obj, type);
  PyObject* args = PyTuple_Pack(1, obj);
  if (args == nullptr) return nullptr;
  PyObject* r = call_through_recorded(g_data_get, args, nullptr, true);
  Py_DECREF(args);
  return r;
}

int data_set(PyObject* self, PyObject* obj, PyObject* value) {
  PyObject* orig = reinterpret_cast<DataDescr*>(self)->orig;
  if (value == nullptr || !wrappers_record() || g_data_set == nullptr)
    return Py_TYPE(orig)->tp_descr_set(orig, obj, value);
  PyObject* args = PyTuple_Pack(2, obj, value);
  if (args == nullptr) return -1;
  PyObject* r = call_through_recorded(g_data_set, args, nullptr, true);
  Py_DECREF(args);
  if (r == nullptr) return -1;
  Py_DECREF(r);
  return 0;
}

void data_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<DataDescr*>(self)->orig);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyType_Slot g_data_slots[] = {
    {Py_tp_descr_get, reinterpret_cast<void*>(&data_get)},
    {Py_tp_descr_set, reinterpret_cast<void*>(&data_set)},
    {Py_tp_dealloc, reinterpret_cast<void*>(&data_dealloc)},
    {Py_tp_doc, const_cast<char*>("Tensor.data, recorded while copytrace traces (level lean)")},
    {0, nullptr}};
PyType_Spec g_data_spec = {"copytrace_observer.DataDescriptor", sizeof(DataDescr), 0,
                           Py_TPFLAGS_DEFAULT, g_data_slots};

// A Tensor method's replacement on the class: read from an instance it is the wrapper bound to
// that instance; read from the class it is the original, so that torch (the `func` a mode or
// a subclass's __torch_function__ receives is looked up on the class), torch.overrides and
// the program see the same callables as untraced.
struct MethodDescr {
  PyObject_HEAD
  PyObject* orig;
  PyObject* wrapper;
};

PyObject* method_get(PyObject* self, PyObject* obj, PyObject*) {
  auto* d = reinterpret_cast<MethodDescr*>(self);
  if (obj == nullptr || obj == Py_None) return Py_NewRef(d->orig);
  return PyMethod_New(d->wrapper, obj);
}

void method_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<MethodDescr*>(self)->orig);
  Py_XDECREF(reinterpret_cast<MethodDescr*>(self)->wrapper);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyType_Slot g_method_slots[] = {
    {Py_tp_descr_get, reinterpret_cast<void*>(&method_get)},
    {Py_tp_dealloc, reinterpret_cast<void*>(&method_dealloc)},
    {Py_tp_doc, const_cast<char*>("a Tensor method recorded while copytrace traces (lean)")},
    {0, nullptr}};
PyType_Spec g_method_spec = {"copytrace_observer.MethodDescriptor", sizeof(MethodDescr), 0,
                             Py_TPFLAGS_DEFAULT, g_method_slots};

PyObject* set_flag(std::atomic<bool>& flag, PyObject* on) {
  const int v = PyObject_IsTrue(on);
  if (v < 0) return nullptr;
  flag.store(v == 1);
  Py_RETURN_NONE;
}

}  // namespace

bool in_quiet_code() {
  if (g_quiet_codes == nullptr) return false;
  // The set's members by identity: hashing a code object hashes its whole contents (~2k
  // instructions per frame). The mirror holds the set, so its address is not reused.
  static PyObject* mirrored = nullptr;
  static Py_ssize_t mirrored_size = -1;
  static std::unordered_set<PyObject*> codes;
  if (mirrored != g_quiet_codes || PySet_GET_SIZE(g_quiet_codes) != mirrored_size) {
    codes.clear();
    Py_XDECREF(mirrored);
    mirrored = Py_NewRef(g_quiet_codes);
    mirrored_size = PySet_GET_SIZE(g_quiet_codes);
    PyObject* it = PyObject_GetIter(g_quiet_codes);
    for (PyObject* item = it ? PyIter_Next(it) : nullptr; item != nullptr; item = PyIter_Next(it)) {
      codes.insert(item);
      Py_DECREF(item);  // the set holds it
    }
    Py_XDECREF(it);
    if (PyErr_Occurred()) PyErr_Clear();
  }
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  bool quiet = false;
  while (frame != nullptr && !quiet) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    quiet = codes.count(reinterpret_cast<PyObject*>(code)) != 0;
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  if (PyErr_Occurred()) PyErr_Clear();
  return quiet;
}

// wrap_api(name, original, method) -> a C function named `name` calling `original` (see above);
// `method`: a MethodDescr for the Tensor class instead
PyObject* py_wrap_api(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "wrap_api(name, original, method)")) return nullptr;
  const char* name = PyUnicode_AsUTF8(argv[0]);
  const int method = name != nullptr ? PyObject_IsTrue(argv[2]) : -1;
  if (method < 0) return nullptr;
  PyObject* orig = argv[1];
  g_wrap_names.emplace_back(name);
  g_wrap_defs.push_back({g_wrap_names.back().c_str(),
                         reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&api_wrapper)),
                         METH_VARARGS | METH_KEYWORDS, "recorded by copytrace while it traces"});
  PyObject* fn = PyCFunction_New(&g_wrap_defs.back(), orig);
  if (fn == nullptr || method == 0) return fn;
  static PyObject* type = PyType_FromSpec(&g_method_spec);
  PyObject* self =
      type != nullptr ? PyType_GenericAlloc(reinterpret_cast<PyTypeObject*>(type), 0) : nullptr;
  if (self == nullptr) {
    Py_DECREF(fn);
    return nullptr;
  }
  reinterpret_cast<MethodDescr*>(self)->orig = Py_NewRef(orig);
  reinterpret_cast<MethodDescr*>(self)->wrapper = fn;
  return self;
}

// data_descriptor(original descriptor, original.__get__, original.__set__)
PyObject* py_data_descriptor(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "data_descriptor(original, get, set)")) return nullptr;
  static PyObject* type = PyType_FromSpec(&g_data_spec);
  if (type == nullptr) return nullptr;
  set_slot(g_data_get, argv[1]);
  set_slot(g_data_set, argv[2]);
  PyObject* self = PyType_GenericAlloc(reinterpret_cast<PyTypeObject*>(type), 0);
  if (self == nullptr) return nullptr;
  reinterpret_cast<DataDescr*>(self)->orig = Py_NewRef(argv[0]);
  return self;
}

PyObject* py_set_wrappers(PyObject*, PyObject* on) { return set_flag(g_wrappers_on, on); }

PyObject* py_set_quiet_codes(PyObject*, PyObject* codes) {
  set_slot(g_quiet_codes, codes);
  Py_RETURN_NONE;
}

}  // namespace copytrace
