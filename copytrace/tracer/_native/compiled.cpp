// Compiled calls (copytrace/tracer/_compiled.py): torch._dynamo's callback_from_stance, the
// enter/exit hook of torch.compile contexts and a compiled graph's backward, in C.
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <algorithm>
#include <cstring>

#include "observer.h"

namespace copytrace {

__thread bool tls_cfs_thread = false;  // the traced thread, while cfs is installed

namespace {

// --- compiled calls: torch._dynamo.eval_frame._callback_from_stance, in C ---------------------
// Called with None by the torch._dynamo.disable wrapper of every compiled graph as the graph
// runs, and with the context's callback by compile_wrapper as a compiled call starts. While
// copytrace's compiled-call hook has a call open (cc_begin, on the traced thread), the None
// case appends the code of the frame that called the wrapper (a dynamo graph's generated code)
// to the call's list; the other case hands a callback that dynamo may call (a frame to
// compile) to copytrace's wrapper (Compiled._wrapped), the last pair kept. Everything then goes
// to torch's own function, so the stance is applied as untraced.
PyObject* g_cfs_orig = nullptr;    // torch's _callback_from_stance
PyObject* g_cfs_state = nullptr;   // the Compiled object (depth, sticky)
PyObject* g_cfs_wrap = nullptr;    // Compiled._wrapped
PyObject* g_cfs_codes = nullptr;   // the open call's graph codes (a list), or null
PyObject* g_cfs_last[2] = {nullptr, nullptr};  // (callback, its wrapper)

void cfs_clear_last() {
  Py_CLEAR(g_cfs_last[0]);
  Py_CLEAR(g_cfs_last[1]);
}

PyObject* cfs_call(PyObject* callback) {
  if (g_cfs_orig == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "copytrace's _callback_from_stance is not installed");
    return nullptr;
  }
  if (callback == Py_None) {
    if (g_cfs_codes != nullptr && tls_cfs_thread) {
      PyFrameObject* wrapper = PyEval_GetFrame();  // borrowed: the disable wrapper's frame
      PyFrameObject* graph = wrapper != nullptr ? PyFrame_GetBack(wrapper) : nullptr;  // new
      if (graph != nullptr) {
        PyCodeObject* code = PyFrame_GetCode(graph);  // new reference
        if (PyList_Append(g_cfs_codes, reinterpret_cast<PyObject*>(code)) < 0) swallow();
        Py_DECREF(code);
        Py_DECREF(graph);
      }
    }
    return PyObject_CallOneArg(g_cfs_orig, callback);
  }
  PyObject* out = PyObject_CallOneArg(g_cfs_orig, callback);
  if (out == nullptr || out == Py_None || out == Py_False || g_cfs_state == nullptr ||
      g_cfs_wrap == nullptr || !tls_cfs_thread)
    return out;
  PyObject* depth = PyObject_GetAttrString(g_cfs_state, "depth");
  PyObject* sticky = PyObject_GetAttrString(g_cfs_state, "sticky");
  const bool wrap = depth != nullptr && sticky != nullptr && PyObject_IsTrue(depth) == 1 &&
                    PyObject_IsTrue(sticky) == 0;
  Py_XDECREF(depth);
  Py_XDECREF(sticky);
  if (PyErr_Occurred()) swallow();
  if (!wrap) return out;
  if (out == g_cfs_last[0]) {
    Py_DECREF(out);
    Py_INCREF(g_cfs_last[1]);
    return g_cfs_last[1];
  }
  PyObject* wrapped = PyObject_CallOneArg(g_cfs_wrap, out);
  if (wrapped == nullptr) {
    swallow();
    return out;  // unwrapped: dynamo still works, copytrace does not step aside for it
  }
  cfs_clear_last();
  g_cfs_last[0] = out;  // the reference `out` held
  Py_INCREF(wrapped);
  g_cfs_last[1] = wrapped;
  return wrapped;
}


// --- compiled calls: the enter/exit hook, in C --------------------------------------------------
// compiled_enter is the hook copytrace adds to every torch.compile context's enter_exit_hooks
// (copytrace/tracer/_compiled.py). The common call (the traced thread, not nested, no mode on
// torch's stacks, no guard reading a patched name) is handled here: depth 1 on the Compiled
// object and the recorder, the observer suppressed, the start time, the step, the compiled
// callable's source (from the wrapper's `fn`, read at each call: source_of), and the list the
// graphs' codes go to (cfs). compiled_leave records the call as one tuple in Compiled._raw
// (graph ids from Compiled._code_graphs, graph_runs counted, the graphs' copies summed), the
// same tuple Compiled._leave makes. Any other call goes to Compiled.enter (Python).
struct CompiledHook {
  PyObject* state = nullptr;        // the Compiled object
  PyObject* rec = nullptr;          // its Recorder
  PyObject* raw = nullptr;          // Compiled._raw
  PyObject* code_graphs = nullptr;  // Compiled._code_graphs: code -> graph id or None
  PyObject* graph_runs = nullptr;   // Compiled.graph_runs: graph id -> runs
  PyObject* module_type = nullptr;  // torch.nn.Module
  PyObject* graphs = nullptr;       // GraphLogHandler.graphs: graph id -> GraphInfo
  PyObject* nothing = nullptr;      // the exit hook of a call not recorded
};
CompiledHook g_cc;
bool g_cc_open = false;  // a call entered by compiled_enter has not left yet
int64_t g_cc_start = 0;
PyObject* g_cc_step = nullptr;
PyObject* g_cc_src = nullptr;
Py_ssize_t g_cc_base = 0;
PyObject* g_cc_leave_fn = nullptr;

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) Py_FatalError("copytrace observer: out of memory interning a name");
  return o;  // kept for the life of the process
}

struct CcNames {
  PyObject *depth, *sticky, *compiled_depth, *step_index, *aside, *enter, *source_for,
      *resolve, *step_back, *copies, *copy_bytes, *fn, *self_, *name_, *wrapped, *code,
      *forward, *call, *call_impl, *wrapped_call_impl;
  CcNames()
      : depth(interned("depth")), sticky(interned("sticky")),
        compiled_depth(interned("compiled_depth")), step_index(interned("step_index")),
        aside(interned("_aside")), enter(interned("enter")),
        source_for(interned("_source_for")), resolve(interned("resolve")),
        step_back(interned("_step_back")), copies(interned("copies")),
        copy_bytes(interned("copy_bytes")), fn(interned("fn")), self_(interned("__self__")),
        name_(interned("__name__")), wrapped(interned("__wrapped__")),
        code(interned("__code__")), forward(interned("forward")), call(interned("__call__")),
        call_impl(interned("_call_impl")), wrapped_call_impl(interned("_wrapped_call_impl")) {}
};
CcNames* g_ccn = nullptr;

// obj.name, or nullptr without an error where obj has no such attribute; nullptr with the
// error set for any other failure.
PyObject* optional_attr(PyObject* obj, PyObject* name) {
  PyObject* value = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  (void)PyObject_GetOptionalAttr(obj, name, &value);
#else
  (void)_PyObject_LookupAttr(obj, name, &value);  // no AttributeError made where it can
#endif
  return value;
}

// Whether fn is a module's __call__ / _call_impl / _wrapped_call_impl (bound).
int is_module_call(PyObject* fn, PyObject* owner) {
  const int module = PyObject_IsInstance(owner, g_cc.module_type);
  if (module <= 0) return module;
  PyObject* name = optional_attr(fn, g_ccn->name_);
  if (name == nullptr) return PyErr_Occurred() ? -1 : 0;
  int found = 0;
  for (PyObject* want : {g_ccn->call, g_ccn->call_impl, g_ccn->wrapped_call_impl}) {
    const int eq = PyObject_RichCompareBool(name, want, Py_EQ);
    if (eq != 0) {
      found = eq;
      break;
    }
  }
  Py_DECREF(name);
  return found;
}

// _calls._source_of in C: (file, first line, name) of the function a compiled callable
// compiles (a module's forward for a module or its bound __call__, through __wrapped__), or
// None; nothing is kept about the callable. Steals fn; nullptr with an error set on failure.
PyObject* source_of(PyObject* fn) {
  for (int i = 0; i < 8; ++i) {
    PyObject* owner = optional_attr(fn, g_ccn->self_);
    if (owner == nullptr && PyErr_Occurred()) break;
    PyObject* next = nullptr;
    int call = 0;
    if (owner != nullptr) {
      call = is_module_call(fn, owner);
      if (call > 0) {
        next = PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(owner)), g_ccn->forward);
      }
      Py_DECREF(owner);
      if (call < 0) break;
    }
    if (call == 0) {
      const int module = PyObject_IsInstance(fn, g_cc.module_type);
      if (module < 0) break;
      if (module > 0) {
        next = PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(fn)), g_ccn->forward);
      } else {
        next = optional_attr(fn, g_ccn->wrapped);
        if (next == Py_None) Py_CLEAR(next);
        if (next == nullptr && !PyErr_Occurred()) break;  // nothing wrapped: fn is the one
      }
    }
    if (next == nullptr) break;
    Py_SETREF(fn, next);
  }
  if (PyErr_Occurred()) {
    Py_DECREF(fn);
    return nullptr;
  }
  PyObject* code = optional_attr(fn, g_ccn->code);
  Py_DECREF(fn);
  if (code == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  if (!PyCode_Check(code)) {  // _source_of reads the attributes of whatever __code__ is
    Py_DECREF(code);
    PyErr_SetString(PyExc_TypeError, "__code__ is not a code object");
    return nullptr;
  }
  PyCodeObject* co = reinterpret_cast<PyCodeObject*>(code);
  PyObject* out = Py_BuildValue("(OiO)", co->co_filename, co->co_firstlineno, co->co_name);
  Py_DECREF(code);
  return out;
}

// The source of the callable the compile_wrapper frame (a caller of the hook) wraps.
PyObject* cc_source() {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed: the frame that calls the hook
  Py_XINCREF(frame);
  for (int i = 0; i < 5 && frame != nullptr; ++i) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    const bool found = PyUnicode_CompareWithASCIIString(code->co_name, "compile_wrapper") == 0;
    Py_DECREF(code);
    if (found) break;
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  if (frame == nullptr) Py_RETURN_NONE;
  PyObject* fn = frame_var_of(frame, g_ccn->fn);
  Py_DECREF(frame);
  if (fn == nullptr) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject* src = source_of(fn);  // steals fn
  if (src != nullptr) return src;
  swallow();
  Py_RETURN_NONE;
}

inline void cc_set_depth(PyObject* value) {
  if (PyObject_SetAttr(g_cc.state, g_ccn->depth, value) < 0) swallow();
  if (PyObject_SetAttr(g_cc.rec, g_ccn->compiled_depth, value) < 0) swallow();
}

PyObject* cc_enter() {
  if (g_cc.state == nullptr || !tls_cfs_thread) {
    if (g_cc.nothing != nullptr) return Py_NewRef(g_cc.nothing);
    Py_RETURN_NONE;  // cannot happen: the hook is in torch's lists only while installed
  }
  PyObject* depth = PyObject_GetAttr(g_cc.state, g_ccn->depth);
  PyObject* sticky = PyObject_GetAttr(g_cc.state, g_ccn->sticky);
  const bool plain = depth != nullptr && sticky != nullptr && !g_cc_open &&
                     PyLong_Check(depth) && PyLong_AsLong(depth) == 0 &&
                     PyObject_IsTrue(sticky) == 0 &&
                     at::impl::PythonTorchFunctionTLS::stack_len() == 0 &&
                     c10::impl::TorchDispatchModeTLS::stack_len() == 0;
  Py_XDECREF(depth);
  Py_XDECREF(sticky);
  if (PyErr_Occurred()) swallow();
  if (!plain) return PyObject_CallMethodNoArgs(g_cc.state, g_ccn->enter);
  PyObject* one = PyLong_FromLong(1);
  cc_set_depth(one);
  Py_DECREF(one);
  suppress_region();
  g_cc_open = true;
  g_cc_start = now_ns();
  Py_XSETREF(g_cc_step, PyObject_GetAttr(g_cc.rec, g_ccn->step_index));
  if (g_cc_step == nullptr) swallow();
  Py_XSETREF(g_cc_src, cc_source());
  g_cc_base = PyDict_GET_SIZE(g_cc.graphs);
  Py_XSETREF(g_cfs_codes, PyList_New(0));
  if (g_cfs_codes == nullptr) swallow();
  return Py_NewRef(g_cc_leave_fn);
}

// The call's graph ids, runs and copies; then its tuple in Compiled._raw.
void cc_record(int64_t end, PyObject* codes) {
  const Py_ssize_t n = codes != nullptr ? PyList_GET_SIZE(codes) : 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyDict_Contains(g_cc.code_graphs, PyList_GET_ITEM(codes, i)) != 1) {
      PyObject* r = PyObject_CallMethodOneArg(g_cc.state, g_ccn->resolve, codes);
      if (r == nullptr) swallow(); else Py_DECREF(r);
      break;
    }
  }
  PyObject* ids = PyList_New(0);
  if (ids == nullptr) return swallow();
  long long copies = 0, nbytes = 0, unknown = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* gid = PyDict_GetItemWithError(g_cc.code_graphs, PyList_GET_ITEM(codes, i));
    if (gid == nullptr || gid == Py_None) continue;
    if (PyList_Append(ids, gid) < 0) break;
    PyObject* runs = PyDict_GetItemWithError(g_cc.graph_runs, gid);
    PyObject* more = PyLong_FromLongLong((runs != nullptr ? PyLong_AsLongLong(runs) : 0) + 1);
    if (more == nullptr || PyDict_SetItem(g_cc.graph_runs, gid, more) < 0) swallow();
    Py_XDECREF(more);
    PyObject* info = PyDict_GetItemWithError(g_cc.graphs, gid);
    if (info == nullptr) {
      ++unknown;
      continue;
    }
    PyObject* list = PyObject_GetAttr(info, g_ccn->copies);
    PyObject* size = PyObject_GetAttr(info, g_ccn->copy_bytes);
    if (list != nullptr && size != nullptr) {
      copies += PyObject_Size(list);
      nbytes += PyLong_AsLongLong(size);
    }
    Py_XDECREF(list);
    Py_XDECREF(size);
  }
  if (PyErr_Occurred()) swallow();
  PyObject* row = Py_BuildValue(
      "(LLOOOnLLL)", static_cast<long long>(g_cc_start), static_cast<long long>(end),
      g_cc_step != nullptr ? g_cc_step : Py_None, g_cc_src != nullptr ? g_cc_src : Py_None, ids,
      PyDict_GET_SIZE(g_cc.graphs) - g_cc_base, copies, nbytes, unknown);
  Py_DECREF(ids);
  if (row == nullptr || PyList_Append(g_cc.raw, row) < 0) swallow();
  Py_XDECREF(row);
}

PyObject* compiled_leave(PyObject*, PyObject*) {
  const int64_t end = now_ns();
  unsuppress_region();
  PyObject* codes = g_cfs_codes;  // owned from here
  g_cfs_codes = nullptr;
  const bool open = g_cc_open;
  g_cc_open = false;
  if (open && g_cc.state != nullptr) {  // else: tracing stopped inside the call
    PyObject* zero = PyLong_FromLong(0);
    cc_set_depth(zero);
    Py_DECREF(zero);
    PyObject* aside = PyObject_GetAttr(g_cc.state, g_ccn->aside);
    if (aside != nullptr && aside != Py_None) {  // dynamo compiled a frame: step back
      PyObject* r = PyObject_CallMethodNoArgs(g_cc.state, g_ccn->step_back);
      if (r == nullptr) swallow(); else Py_DECREF(r);
    }
    Py_XDECREF(aside);
    if (PyErr_Occurred()) swallow();
    cc_record(end, codes);
  }
  Py_XDECREF(codes);
  Py_CLEAR(g_cc_step);
  Py_CLEAR(g_cc_src);
  Py_RETURN_NONE;
}

// compiled_backward(fn, *args): a compiled graph's backward (CompiledFunctionBackward's user
// function), run as a compiled call's depth on the traced thread with the observer suppressed;
// with a mode on torch's stacks, or on another thread, Compiled._run_backward (Python) runs it.
PyObject* g_cc_run_backward = nullptr;  // interned "_run_backward"

PyObject* cc_backward(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "compiled_backward(fn, *args)");
    return nullptr;
  }
  if (g_cc.state == nullptr) return PyObject_Vectorcall(args[0], args + 1, nargs - 1, nullptr);
  if (!tls_cfs_thread || at::impl::PythonTorchFunctionTLS::stack_len() != 0 ||
      c10::impl::TorchDispatchModeTLS::stack_len() != 0) {
    PyObject* slow = PyObject_GetAttr(g_cc.state, g_cc_run_backward);
    if (slow == nullptr) return nullptr;
    PyObject* r = PyObject_Vectorcall(slow, args, nargs, nullptr);
    Py_DECREF(slow);
    return r;
  }
  PyObject* state = g_cc.state;  // held for the call: tracing may stop inside it
  Py_INCREF(state);
  PyObject* rec = g_cc.rec;
  Py_INCREF(rec);
  auto set_depth = [&](long delta) {
    PyObject* depth = PyObject_GetAttr(state, g_ccn->depth);
    long d = depth != nullptr ? PyLong_AsLong(depth) : 0;
    Py_XDECREF(depth);
    PyObject* value = PyLong_FromLong(std::max(0L, d + delta));
    if (value == nullptr || PyObject_SetAttr(state, g_ccn->depth, value) < 0 ||
        PyObject_SetAttr(rec, g_ccn->compiled_depth, value) < 0)
      swallow();
    Py_XDECREF(value);
    if (PyErr_Occurred()) swallow();
  };
  set_depth(1);
  suppress_region();
  PyObject* result = PyObject_Vectorcall(args[0], args + 1, nargs - 1, nullptr);
  PyObject *etype = nullptr, *evalue = nullptr, *etb = nullptr;
  if (result == nullptr) PyErr_Fetch(&etype, &evalue, &etb);
  unsuppress_region();
  set_depth(-1);
  if (result == nullptr) PyErr_Restore(etype, evalue, etb);
  Py_DECREF(rec);
  Py_DECREF(state);
  return result;
}


// BackwardCFunction._get_user_fn, in C (an instance method): torch's own, and for a compiled
// graph's backward (CompiledFunctionBackward) that user function bound to compiled_backward.
PyObject* g_uf_orig = nullptr;     // torch's BackwardCFunction._get_user_fn
PyObject* g_uf_partial = nullptr;  // functools.partial
PyObject* g_uf_run = nullptr;      // compiled_backward

PyObject* user_fn(PyObject*, PyObject* node) {
  if (g_uf_orig == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "copytrace's _get_user_fn is not installed");
    return nullptr;
  }
  PyObject* fn = PyObject_CallOneArg(g_uf_orig, node);
  if (fn == nullptr || g_uf_run == nullptr ||
      std::strcmp(Py_TYPE(node)->tp_name, "CompiledFunctionBackward") != 0)
    return fn;
  PyObject* bound = PyObject_CallFunctionObjArgs(g_uf_partial, g_uf_run, fn, nullptr);
  if (bound == nullptr) {
    swallow();
    return fn;
  }
  Py_DECREF(fn);
  return bound;
}

PyMethodDef g_user_fn_def = {"_get_user_fn", &user_fn, METH_O,
                             "copytrace's BackwardCFunction._get_user_fn (see compiled.cpp)"};

PyMethodDef g_cc_leave_def = {"compiled_leave", &compiled_leave, METH_NOARGS,
                              "the exit hook of a call compiled_enter recorded"};

}  // namespace

// cfs_install(orig, state, wrap) on the traced thread; cfs_install(None, None, None) clears.
PyObject* py_cfs_install(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "cfs_install(orig, state, wrap)")) return nullptr;
  cfs_clear_last();
  Py_CLEAR(g_cfs_codes);
  tls_cfs_thread = argv[0] != Py_None;
  set_slot(g_cfs_orig, argv[0]);
  set_slot(g_cfs_state, argv[1]);
  set_slot(g_cfs_wrap, argv[2]);
  Py_RETURN_NONE;
}

// cfs_begin(list) as a compiled call starts (the list collects its graphs' codes), None at its
// end.
PyObject* py_cfs_begin(PyObject*, PyObject* codes) {
  set_slot(g_cfs_codes, codes);
  Py_RETURN_NONE;
}

// user_fn_install(orig, partial, run) -> the instance method to set on BackwardCFunction;
// user_fn_install(None, None, None) clears (torch's own must be put back first).
PyObject* py_user_fn_install(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "user_fn_install(orig, partial, run)")) return nullptr;
  const bool on = argv[0] != Py_None;
  set_slot(g_uf_orig, argv[0]);
  set_slot(g_uf_partial, argv[1]);
  set_slot(g_uf_run, argv[2]);
  if (!on) Py_RETURN_NONE;
  PyObject* fn = PyCFunction_NewEx(&g_user_fn_def, nullptr, nullptr);
  if (fn == nullptr) return nullptr;
  PyObject* method = PyInstanceMethod_New(fn);
  Py_DECREF(fn);
  return method;
}

// cc_install(state, rec, raw, code_graphs, graph_runs, module_type, graphs, nothing) on the traced
// thread; cc_install(None, ...) clears and returns whether a call compiled_enter recorded is
// still open (tracing stops inside it: its exit only unsuppresses).
PyObject* py_cc_install(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 8,
             "cc_install(state, rec, raw, code_graphs, graph_runs, module_type, graphs, "
             "nothing)"))
    return nullptr;
  if (g_ccn == nullptr) g_ccn = new CcNames();
  if (g_cc_run_backward == nullptr) g_cc_run_backward = interned("_run_backward");
  if (g_cc_leave_fn == nullptr) {
    g_cc_leave_fn = PyCFunction_NewEx(&g_cc_leave_def, nullptr, nullptr);
    if (g_cc_leave_fn == nullptr) return nullptr;
  }
  const bool was_open = g_cc_open;
  if (argv[0] == Py_None) g_cc_open = false;
  PyObject** slots[] = {&g_cc.state,      &g_cc.rec,     &g_cc.raw,    &g_cc.code_graphs,
                        &g_cc.graph_runs, &g_cc.module_type, &g_cc.graphs, &g_cc.nothing};
  for (size_t i = 0; i < 8; ++i) set_slot(*slots[i], argv[i]);
  return Py_NewRef(was_open ? Py_True : Py_False);
}

PyObject* py_callback_from_stance(PyObject*, PyObject* callback) { return cfs_call(callback); }

PyObject* py_compiled_enter(PyObject*, PyObject*) { return cc_enter(); }

// compiled_backward(fn, *args)
PyObject* py_compiled_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return cc_backward(args, nargs);
}

}  // namespace copytrace
