// warnings.warn while tracing.
//
// Installed as warnings.warn (copytrace/tracer/_warnshim.py): a C function, so it adds no
// frame to tracebacks (-W error) and stacklevel 1 is still the caller. Where the frames
// between the caller and the stacklevel's target include a handle_torch_function frame that
// copytrace's mode re-entered from (tls_entry_frames, api_mode.cpp), that frame and the outer
// call of the same torch function above it are not counted: the warning names the frame it
// names untraced. Everything else goes to the original warnings.warn unchanged.
// Python only: no torch header.
#include "observer.h"

#include <algorithm>

namespace copytrace {
namespace {

PyObject* g_orig_warn = nullptr;

bool entry_frame(PyFrameObject* frame) {
  PyObject** end = tls_entry_frames.data + tls_entry_frames.size;
  return std::find(tls_entry_frames.data, end, reinterpret_cast<PyObject*>(frame)) != end;
}

PyObject* warn_shim(PyObject*, PyObject* args, PyObject* kwargs) {
  if (g_orig_warn == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "copytrace warnings shim not installed");
    return nullptr;
  }
  if (tls_entry_frames.size == 0) return PyObject_Call(g_orig_warn, args, kwargs);
  // stacklevel: third positional argument or keyword
  Py_ssize_t nargs = PyTuple_GET_SIZE(args);
  PyObject* level_obj = nargs > 2 ? PyTuple_GET_ITEM(args, 2)
                                  : (kwargs ? PyDict_GetItemString(kwargs, "stacklevel") : nullptr);
  long level = level_obj ? PyLong_AsLong(level_obj) : 1;
  if (level == -1 && PyErr_Occurred()) return nullptr;
  if (level <= 1) return PyObject_Call(g_orig_warn, args, kwargs);
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed: the caller of warn
  Py_XINCREF(frame);
  long steps = 0, counted = 1;
  auto back = [](PyFrameObject*& f) {
    PyFrameObject* b = PyFrame_GetBack(f);  // new reference
    Py_DECREF(f);
    f = b;
  };
  while (frame != nullptr && counted < level) {
    back(frame);
    ++steps;
    if (frame != nullptr && entry_frame(frame)) {
      back(frame);  // the outer call of the same torch function
      if (frame != nullptr) back(frame);
      steps += 2;
    }
    ++counted;
  }
  Py_XDECREF(frame);
  long adjusted = steps + 1;  // stacklevel 1 = the caller
  if (adjusted == level) return PyObject_Call(g_orig_warn, args, kwargs);
  PyObject* new_level = PyLong_FromLong(adjusted);
  if (new_level == nullptr) return nullptr;
  PyObject* result = nullptr;
  if (nargs > 2) {
    PyObject* copy = PyTuple_GetSlice(args, 0, nargs);
    if (copy != nullptr) {
      Py_INCREF(new_level);
      PyObject* old = PyTuple_GET_ITEM(copy, 2);
      PyTuple_SET_ITEM(copy, 2, new_level);
      Py_DECREF(old);
      result = PyObject_Call(g_orig_warn, copy, kwargs);
      Py_DECREF(copy);
    }
  } else {
    PyObject* kw = kwargs ? PyDict_Copy(kwargs) : PyDict_New();
    if (kw != nullptr && PyDict_SetItemString(kw, "stacklevel", new_level) == 0)
      result = PyObject_Call(g_orig_warn, args, kw);
    Py_XDECREF(kw);
  }
  Py_DECREF(new_level);
  return result;
}

PyMethodDef g_warn_def = {"warn", reinterpret_cast<PyCFunction>(
                              reinterpret_cast<void (*)()>(&warn_shim)),
                          METH_VARARGS | METH_KEYWORDS,
                          "warnings.warn, counting stacklevel as untraced (copytrace)"};

}  // namespace

// make_warn(orig): a warnings.warn that calls `orig` with the stacklevel counted as untraced
PyObject* py_make_warn(PyObject*, PyObject* orig) {
  set_slot(g_orig_warn, orig);
  return PyCFunction_New(&g_warn_def, nullptr);
}

}  // namespace copytrace
