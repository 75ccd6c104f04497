// Frames: the user's and the library's call sites, the innermost Module._call_impl frame, a frame's variable.
// Python only: no torch header.
#include "observer.h"

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
// Python 3.11: the interpreter frame's layout, for frame_var (no public accessor before 3.12)
#define Py_BUILD_CORE 1
#include <internal/pycore_code.h>
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif

#include <functional>
#include <unordered_map>
#include <vector>

namespace copytrace {
namespace {

// call_site(classify): (file, line, function, via, library) of the innermost user-code frame
// on the calling thread's stack, as copytrace/tracer/_callsite.py's call_site() finds it, or
// None; library: (file, line, function) of the innermost library frame below the user's, or
// None. classify(code) gives a code object's kind (0 user, 1 torch, 2 copytrace or the
// stdlib, 3 a mode's handler, 4 an installed package other than torch, 5 code compiled from a
// string: classify(code, globals' __file__) then says which), kept per code object
// (by identity: hashing a code object hashes its whole contents). The user
// frame's (file, line, function) is cached per (code object, instruction): a line number is
// otherwise a scan of the code's line table. The cache holds its code objects (never frames).
struct SiteKey {
  PyObject* code;
  int lasti;
  bool operator==(const SiteKey& o) const { return code == o.code && lasti == o.lasti; }
};
struct SiteKeyHash {
  size_t operator()(const SiteKey& k) const {
    return std::hash<void*>()(k.code) ^ (std::hash<int>()(k.lasti) * 31);
  }
};
std::unordered_map<SiteKey, PyObject*, SiteKeyHash> g_sites;  // -> (file, line, name), owned
// library frames: -> (file, line, qualified name), owned
std::unordered_map<SiteKey, PyObject*, SiteKeyHash> g_lib_sites;
std::unordered_map<PyObject*, int> g_kinds;  // code object (owned) -> kind
constexpr size_t kMaxSites = 1 << 16;

void clear_sites() {
  for (auto* sites : {&g_sites, &g_lib_sites}) {
    for (auto& [key, site] : *sites) {
      Py_DECREF(key.code);
      Py_DECREF(site);
    }
    sites->clear();
  }
  for (auto& [code, kind] : g_kinds) Py_DECREF(code);
  g_kinds.clear();
}

// (file, line, name) of a frame, cached per (code, instruction); a library frame's name is
// its qualified name (Trainer._prepare_input).
PyObject* frame_site(PyFrameObject* frame, PyCodeObject* code, bool library) {
  auto& sites = library ? g_lib_sites : g_sites;
  const SiteKey key{reinterpret_cast<PyObject*>(code), PyFrame_GetLasti(frame)};
  auto found = sites.find(key);
  if (found != sites.end()) return Py_NewRef(found->second);
  PyObject* site = Py_BuildValue("(OiO)", code->co_filename, PyFrame_GetLineNumber(frame),
                                 library ? code->co_qualname : code->co_name);
  if (site == nullptr) return nullptr;
  if (sites.size() >= kMaxSites) clear_sites();
  Py_INCREF(key.code);
  sites.emplace(key, Py_NewRef(site));
  return site;
}

}  // namespace

PyObject* py_clear_sites(PyObject*, PyObject*) {
  clear_sites();
  Py_RETURN_NONE;
}

PyObject* call_site(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "call_site(classify)");
    return nullptr;
  }
  PyObject* via = nullptr;  // borrowed from a code object we hold while walking
  PyObject* lib = nullptr;  // (file, line, function) of the innermost library frame, owned
  PyObject* result = nullptr;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  std::vector<PyCodeObject*> held;  // codes whose qualname `via` may borrow
  bool failed = false;
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    long kind;
    auto known = g_kinds.find(reinterpret_cast<PyObject*>(code));
    if (known != g_kinds.end()) {
      kind = known->second;
    } else {
      PyObject* k = PyObject_CallOneArg(argv[0], reinterpret_cast<PyObject*>(code));
      kind = k != nullptr ? PyLong_AsLong(k) : -1;
      Py_XDECREF(k);
      if (kind == -1 && PyErr_Occurred()) {
        Py_DECREF(code);
        failed = true;
        break;
      }
      if (g_kinds.size() >= kMaxSites) clear_sites();
      Py_INCREF(code);  // held by the map: its address is not reused while there
      g_kinds.emplace(reinterpret_cast<PyObject*>(code), static_cast<int>(kind));
    }
    if (kind == 5) {  // code compiled from a string: the kind of its globals' file
      PyObject* globals = PyFrame_GetGlobals(frame);  // new reference
      PyObject* file = globals != nullptr ? PyDict_GetItemString(globals, "__file__") : nullptr;
      PyObject* k = PyObject_CallFunctionObjArgs(argv[0], reinterpret_cast<PyObject*>(code),
                                                 file != nullptr ? file : Py_False, nullptr);
      Py_XDECREF(globals);
      kind = k != nullptr ? PyLong_AsLong(k) : -1;
      Py_XDECREF(k);
      if (kind == -1 && PyErr_Occurred()) {
        Py_DECREF(code);
        failed = true;
        break;
      }
      g_kinds[reinterpret_cast<PyObject*>(code)] = static_cast<int>(kind);  // held already
    }
    if (kind == 0) {
      PyObject* site = frame_site(frame, code, false);
      if (site != nullptr) {
        result = PyTuple_Pack(5, PyTuple_GET_ITEM(site, 0), PyTuple_GET_ITEM(site, 1),
                              PyTuple_GET_ITEM(site, 2), via != nullptr ? via : Py_None,
                              lib != nullptr ? lib : Py_None);
        Py_DECREF(site);
      }
      failed = result == nullptr;
      Py_DECREF(code);
      break;
    }
    // kind 4: an installed package other than torch: the via, and the library site
    if (kind == 4 && lib == nullptr) {
      lib = frame_site(frame, code, true);
      if (lib == nullptr) {
        Py_DECREF(code);
        failed = true;
        break;
      }
    }
    if ((kind == 1 || kind == 4) && via == nullptr) {
      via = code->co_qualname;
      held.push_back(code);
    } else {
      Py_DECREF(code);
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  if (!failed && result == nullptr && frame == nullptr) {
    // no user frame on the stack: the library site alone, or None
    result = lib == nullptr ? Py_NewRef(Py_None)
                            : PyTuple_Pack(5, Py_None, Py_None, Py_None,
                                           via != nullptr ? via : Py_None, lib);
  }
  Py_XDECREF(lib);
  Py_XDECREF(frame);
  for (PyCodeObject* code : held) Py_DECREF(code);
  return result;
}

// The innermost frame running `code` (Module._call_impl) on this thread's stack, or None.
PyObject* innermost_frame_of(PyObject* code) {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* c = PyFrame_GetCode(frame);  // new reference
    const bool found = reinterpret_cast<PyObject*>(c) == code;
    Py_DECREF(c);
    if (found) return reinterpret_cast<PyObject*>(frame);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_RETURN_NONE;
}

// frame_var(frame, name): the value of a running frame's local, cell or free variable
// `name`, without building the frame's f_locals dict (which copies every variable, at every
// compiled call: copytrace reads torch.compile's wrapper's `fn` this way); NameError when the
// frame has no such variable bound. Python 3.12+: PyFrame_GetVar; 3.11: the interpreter
// frame's localsplus array (Include/internal/pycore_frame.h), cells read through; older: f_locals.
PyObject* frame_var_of(PyFrameObject* frame, PyObject* name) {
#if PY_VERSION_HEX >= 0x030C0000
  return PyFrame_GetVar(frame, name);
#elif PY_VERSION_HEX >= 0x030B0000
  _PyInterpreterFrame* fr = frame->f_frame;
  PyCodeObject* co = fr->f_code;
  PyObject* names = co->co_localsplusnames;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); ++i) {
    PyObject* n = PyTuple_GET_ITEM(names, i);
    if (n != name && PyUnicode_Compare(n, name) != 0) continue;
    PyObject* value = fr->localsplus[i];
    const _PyLocals_Kind kind = _PyLocals_GetKind(co->co_localspluskinds, static_cast<int>(i));
    if (value != nullptr && (kind & (CO_FAST_CELL | CO_FAST_FREE)) && PyCell_Check(value))
      value = PyCell_GET(value);
    if (value == nullptr) break;
    Py_INCREF(value);
    return value;
  }
  PyErr_Format(PyExc_NameError, "variable %R does not exist", name);
  return nullptr;
#else
  // older Pythons: through f_locals (a dict of every variable, built for this read)
  PyObject* locals = PyObject_GetAttrString(reinterpret_cast<PyObject*>(frame), "f_locals");
  if (locals == nullptr) return nullptr;
  PyObject* value = PyObject_GetItem(locals, name);
  Py_DECREF(locals);
  if (value == nullptr && PyErr_ExceptionMatches(PyExc_KeyError)) {
    PyErr_Clear();
    PyErr_Format(PyExc_NameError, "variable %R does not exist", name);
  }
  return value;
#endif
}

// module_calls(frame, code): the `self` of every frame running `code` (Module._call_impl) at
// or above `frame`, outermost first: the module calls in progress (tracer/_modules.py names
// an event's module from them). One walk, no f_locals dict, nothing kept.
PyObject* py_module_calls(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 2 || !PyFrame_Check(argv[0])) {
    PyErr_SetString(PyExc_TypeError, "module_calls(frame, code)");
    return nullptr;
  }
  static PyObject* self_name = PyUnicode_InternFromString("self");  // kept for the process
  if (self_name == nullptr) return nullptr;
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
  // 3.11: the interpreter frames themselves (Include/internal/pycore_frame.h), so that no
  // frame object is made for each frame passed (PyFrame_GetBack makes one); incomplete
  // frames skipped as PyFrame_GetBack skips them; `self` read as frame_var_of reads it
  for (_PyInterpreterFrame* fr = reinterpret_cast<PyFrameObject*>(argv[0])->f_frame;
       fr != nullptr; fr = fr->previous) {
    if (_PyFrame_IsIncomplete(fr) || reinterpret_cast<PyObject*>(fr->f_code) != argv[1])
      continue;
    PyCodeObject* co = fr->f_code;
    PyObject* self = nullptr;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(co->co_localsplusnames); ++i) {
      PyObject* n = PyTuple_GET_ITEM(co->co_localsplusnames, i);
      if (n != self_name && PyUnicode_Compare(n, self_name) != 0) continue;
      self = fr->localsplus[i];
      const _PyLocals_Kind kind = _PyLocals_GetKind(co->co_localspluskinds, static_cast<int>(i));
      if (self != nullptr && (kind & (CO_FAST_CELL | CO_FAST_FREE)) && PyCell_Check(self))
        self = PyCell_GET(self);
      break;
    }
    if (self == nullptr) {
      Py_DECREF(out);
      PyErr_SetString(PyExc_NameError, "module_calls: a frame without self");
      return nullptr;
    }
    if (PyList_Append(out, self) < 0) {
      Py_DECREF(out);
      return nullptr;
    }
  }
#else
  PyFrameObject* frame = reinterpret_cast<PyFrameObject*>(argv[0]);
  Py_INCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* c = PyFrame_GetCode(frame);  // new reference
    const bool found = reinterpret_cast<PyObject*>(c) == argv[1];
    Py_DECREF(c);
    if (found) {
      PyObject* self = frame_var_of(frame, self_name);
      if (self == nullptr || PyList_Append(out, self) < 0) {
        Py_XDECREF(self);
        Py_DECREF(frame);
        Py_DECREF(out);
        return nullptr;
      }
      Py_DECREF(self);
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
#endif
  if (PyList_Reverse(out) < 0) {
    Py_DECREF(out);
    return nullptr;
  }
  return out;
}

PyObject* py_frame_var(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 2 || !PyFrame_Check(argv[0]) || !PyUnicode_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "frame_var(frame, name)");
    return nullptr;
  }
  return frame_var_of(reinterpret_cast<PyFrameObject*>(argv[0]), argv[1]);
}

}  // namespace copytrace
