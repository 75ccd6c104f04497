// The API level: the TorchFunctionMode's handler, in C.
//
// Installed as the mode object's __torch_function__. A call that is not in the table goes
// straight to `func` from C: no Python frame of copytrace's is on the stack, so a warning torch
// raises names the same frame, module and line as untraced, and the per-call cost is a dict
// lookup. A recorded call runs before(op, func, args, kwargs) -> token, then `func` (from C),
// then after(token, result, error type, t0, t1, folded aten names); both hooks run with torch
// function handling disabled, so no other mode or subclass sees copytrace's bookkeeping.
// Level lean's wrappers and hot-patched pointers (lean.cpp, hotpatch.cpp) record through the
// same call_through_recorded.
// Python only but for ATen's torch-function TLS header (NoTorchFunction, observer.h): a tensor's
// autograd node is read in facts.cpp (grad_fn_sequence_nr).
#define COPYTRACE_TORCH_TLS
#include "observer.h"

namespace copytrace {

PyObject* g_table = nullptr;  // dict: torch callable -> op name
__thread TlsStack<PyObject*> tls_entry_frames = {nullptr, 0, 0};

namespace {

PyObject* g_before = nullptr;
PyObject* g_after = nullptr;
PyObject* g_write_hook = nullptr;  // called for every call while g_watch_writes
// One call instead of before + after (set_fast_api): a call of an op in g_fast_ops, with no
// keyword arguments, whose first argument's type is exactly one of g_fast_types (torch.Tensor,
// nn.Parameter), runs from C and then goes to g_fast_after(op, args, result, error type, t0,
// t1, folded aten names). The before hook has nothing to do for such a call: no torch function
// override or Python code of the program's can run inside it.
PyObject* g_fast_ops = nullptr;    // frozenset of op names
PyObject* g_fast_types = nullptr;  // tuple of exact types
PyObject* g_fast_after = nullptr;
std::atomic<bool> g_watch_writes{false};
// In-place writes into fresh copies (copytrace/tracer/_fresh.py): g_fresh maps id(tensor) of
// the live copies to their entries, g_written holds the written advanced-index results that
// wait for a use. g_copy_hook(func, args, kwargs) runs only for a call whose first argument is
// in g_fresh, or any call while g_written is not empty.
PyObject* g_fresh = nullptr;
PyObject* g_written = nullptr;
PyObject* g_copy_hook = nullptr;
PyObject* g_getitem = nullptr;  // Tensor.__getitem__: basic indexing returns a view, no event

// An index of ints, slices, None, Ellipsis (or a tuple of them): basic indexing.
inline bool basic_item(PyObject* o) {
  return PyLong_Check(o) || PySlice_Check(o) || o == Py_None || o == Py_Ellipsis;
}

inline bool basic_index(PyObject* args) {
  if (PyTuple_GET_SIZE(args) < 2) return false;
  PyObject* index = PyTuple_GET_ITEM(args, 1);
  if (basic_item(index)) return true;
  if (!PyTuple_CheckExact(index)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(index); ++i) {
    if (!basic_item(PyTuple_GET_ITEM(index, i))) return false;
  }
  return true;
}

inline bool copy_hook_wanted(PyObject* args) {
  if (g_copy_hook == nullptr || g_fresh == nullptr || PyDict_GET_SIZE(g_fresh) == 0) return false;
  if (g_written != nullptr && PyDict_GET_SIZE(g_written) > 0) return true;
  if (PyTuple_GET_SIZE(args) == 0) return false;
  PyObject* key = PyLong_FromVoidPtr(PyTuple_GET_ITEM(args, 0));  // id(args[0])
  if (key == nullptr) {
    PyErr_Clear();
    return false;
  }
  int found = PyDict_Contains(g_fresh, key);
  Py_DECREF(key);
  if (found < 0) PyErr_Clear();
  return found == 1;
}

// Whether obj's type is exactly one of g_fast_types (torch.Tensor, nn.Parameter: a plain
// tensor, as THPVariable_CheckExact reads it).
inline bool fast_type(PyObject* obj) {
  if (g_fast_types == nullptr) return false;
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  bool exact = false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g_fast_types); ++i)
    exact = exact || PyTuple_GET_ITEM(g_fast_types, i) == type;
  return exact;
}

inline bool fast_call(PyObject* op, PyObject* args, PyObject* kwargs) {
  if (kwargs != nullptr && kwargs != Py_None &&
      (!PyDict_Check(kwargs) || PyDict_GET_SIZE(kwargs) != 0))
    return false;
  if (PyTuple_GET_SIZE(args) == 0 || g_fast_ops == nullptr) return false;
  if (!fast_type(PyTuple_GET_ITEM(args, 0))) return false;
  int found = PySet_Contains(g_fast_ops, op);
  if (found < 0) PyErr_Clear();
  return found == 1;
}

// The whole event of a fast call, in C, where it is the common case: record.cpp's record
// builds it with its call site, phase and module placed, and no grad_fn to tag; the watch has
// nothing to start (an alias, or a fresh copy followed by its version counter); it is appended
// to the recorder's events. Any other outcome goes to g_fast_tail(op, src, out, ev, grad_fn,
// placed) (Recorder.api_tail), and a call record cannot read (not a plain tensor) to
// g_fast_after. Returns false for the latter.
PyObject* g_fast_rec = nullptr;        // the Recorder
PyObject* g_fast_copies = nullptr;     // its watch's FreshCopies
PyObject* g_fast_tail = nullptr;
PyObject* g_fast_watch = nullptr;      // the Recorder's Watch
PyObject* g_fast_event_ops = nullptr;  // frozenset: ops whose event may be finished here

PyObject* intern_name(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) Py_FatalError("copytrace observer: out of memory interning a name");
  return o;  // kept for the life of the process
}

// Attribute names the fast path reads and writes, interned once.
struct FastNames {
  PyObject *group, *native_state, *events, *dropped, *step_index, *in_optimizer, *alias, *via,
      *graph, *bytes_allocated, *inplace_writes, *max_events, *overhead_ns, *kept, *limit,
      *prune, *detach, *flush_at, *full;
  FastNames()
      : group(intern_name("group")), native_state(intern_name("_native_state")),
        events(intern_name("events")), dropped(intern_name("dropped")),
        step_index(intern_name("step_index")), in_optimizer(intern_name("in_optimizer")),
        alias(intern_name("alias")), via(intern_name("via")), graph(intern_name("graph")),
        bytes_allocated(intern_name("bytes_allocated")),
        inplace_writes(intern_name("inplace_writes")), max_events(intern_name("max_events")),
        overhead_ns(intern_name("overhead_ns")), kept(intern_name("kept")),
        limit(intern_name("_limit")), prune(intern_name("_prune")),
        detach(intern_name("detach")), flush_at(intern_name("flush_at")),
        full(intern_name("full")) {}
};
FastNames* g_fn = nullptr;

// attribute `name` of `obj` as a long long (-1 and an error set on failure)
inline long long attr_ll(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) return -1;
  long long r = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return r;
}

inline bool add_ll(PyObject* obj, PyObject* name, long long delta) {
  long long v = attr_ll(obj, name);
  if (v == -1 && PyErr_Occurred()) return false;
  PyObject* n = PyLong_FromLongLong(v + delta);
  if (n == nullptr) return false;
  int rc = PyObject_SetAttr(obj, name, n);
  Py_DECREF(n);
  return rc == 0;
}

// A fresh copy's version counter (`version`, borrowed) kept in FreshCopies (_fresh.py) with
// its event; false: an error, for the caller to count.
bool keep_version(PyObject* version, PyObject* ev) {
  PyObject* kept = PyObject_GetAttr(g_fast_copies, g_fn->kept);
  PyObject* zero = PyLong_FromLong(0);
  PyObject* item = kept_pair(version, ev);  // untracked: see versions.cpp
  bool ok = kept != nullptr && zero != nullptr && item != nullptr &&
            PyObject_SetAttr(ev, g_fn->inplace_writes, zero) == 0 && PyList_Check(kept) &&
            PyList_Append(kept, item) == 0;
  Py_XDECREF(zero);
  Py_XDECREF(item);
  if (ok) {
    const long long limit = attr_ll(g_fast_copies, g_fn->limit);
    if (PyList_GET_SIZE(kept) >= limit) {
      PyObject* r = PyObject_CallMethodNoArgs(g_fast_copies, g_fn->prune);
      if (r == nullptr) ok = false; else Py_DECREF(r);
    }
  }
  Py_XDECREF(kept);
  return ok;
}

// The event's end, when nothing calls for Python: true when done (or an error counted).
// Watch.follow's rules (copytrace/tracer/watch/_watch.py) by RULES.watched, RULES.not_fresh and
// RULES.alias_watched.
// An attached copy (grad_fn not None) goes to attached.cpp's attached_finish, which tags its
// grad_fn and lists it as Watch.follow would, or leaves it to Python.
// The event's fields fast_finish reads, in place (schema.CopyEvent's slots).
enum EventSlot : int { EV_alias, EV_via, EV_graph, EV_bytes, EV_grad_fn, EV_COUNT };
const char* const kEventSlots[EV_COUNT] = {"alias", "via", "graph", "bytes_allocated", "grad_fn"};
Slots<EV_COUNT> g_ev{kEventSlots};

bool fast_finish(PyObject* op, PyObject* src, PyObject* out, PyObject* ev, PyObject* grad_fn) {
  if (g_rule_watched == nullptr || g_rule_not_fresh == nullptr) return false;  // no rules set
  if (!g_ev.of(ev) || g_ev.get(ev, EV_alias) == nullptr) return false;
  const bool alias = g_ev.get(ev, EV_alias) == Py_True;
  if (alias && grad_fn != Py_None) return false;  // an alias's grad_fn: tagged in Python
  const int watched = PySet_Contains(g_rule_watched, op);
  if (watched != 0) {  // watched: only a detach without a via (not from state_dict()) is not
    if (watched < 0 || PyUnicode_Compare(op, g_fn->detach) != 0) return false;
    if (g_ev.get(ev, EV_via) != Py_None) return false;
  }
  if (alias && g_rule_alias_watched != nullptr) {  // may be watched for a write: Python decides
    const int maybe = PySet_Contains(g_rule_alias_watched, op);
    if (maybe != 0) return false;
  }
  if (!alias) {
    PyObject* graph = g_ev.get(ev, EV_graph);
    const bool attached = graph != nullptr && PyUnicode_Check(graph) &&
                          PyUnicode_CompareWithASCIIString(graph, "attached") == 0;
    if (graph == nullptr || (attached && grad_fn == Py_None)) return false;
    PyObject* bytes = g_ev.get(ev, EV_bytes);
    if (bytes == nullptr || !PyLong_Check(bytes)) return false;
    const long long nbytes = PyLong_AsLongLong(bytes);
    if (nbytes == -1 && PyErr_Occurred()) return false;
    const int not_fresh = out == src ? 1 : PySet_Contains(g_rule_not_fresh, op);
    if (not_fresh < 0) return false;
    PyObject* version = nullptr;  // a fresh copy's version counter (_fresh.py)
    if (not_fresh == 0 && nbytes > 0) {
      version = version_of(nullptr, out);
      if (version == nullptr || version == Py_None) {
        Py_XDECREF(version);
        return false;
      }
    }
    if (attached) {  // Recorder.api_tail's tag and Watch.follow's entry, before the version
      PyObject* kind = Py_XNewRef(g_ev.get(ev, EV_grad_fn));
      const int done = kind != nullptr ? attached_finish(g_fast_rec, g_fast_watch, ev, out,
                                                         grad_fn, kind)
                                       : 0;
      Py_XDECREF(kind);
      if (done == 0) {
        Py_XDECREF(version);
        PyErr_Clear();
        return false;
      }
      if (done < 0) swallow();  // counted; the event is still kept below
    }
    if (version != nullptr) {  // a fresh copy: its version counter kept
      const bool ok = keep_version(version, ev);
      Py_DECREF(version);
      if (!ok) swallow();  // counted; the event is still kept below
    }
  }
  PyObject* events = PyObject_GetAttr(g_fast_rec, g_fn->events);
  const long long max_events = attr_ll(g_fast_rec, g_fn->max_events);
  if (events == nullptr || !PyList_Check(events) || PyErr_Occurred()) {
    Py_XDECREF(events);
    swallow();
    return true;
  }
  if (PyList_GET_SIZE(events) < max_events) {
    if (PyList_Append(events, ev) < 0) swallow();
  } else if (!add_ll(g_fast_rec, g_fn->dropped, 1)) {
    swallow();
  }
  Py_DECREF(events);
  return true;
}

// The recorder's buffer `events` holding its `flush_at` records: its full(), a flush by count
// (copytrace/tracer/_buffer.py), called once the call's event is complete, after the op
// returned (no kernel and no dispatcher state of it is running) and with torch function
// handling off, as the Python tail is. One attribute read per event; errors counted.
void check_full(PyObject* events) {
  const long long at = attr_ll(g_fast_rec, g_fn->flush_at);
  if (at == -1 && PyErr_Occurred()) {
    swallow();
    return;
  }
  if (PyList_GET_SIZE(events) < at) return;
  PyObject* r = PyObject_CallMethodNoArgs(g_fast_rec, g_fn->full);
  if (r == nullptr) swallow(); else Py_DECREF(r);
}

// Record a fast call's event (result `out`, no error); false: g_fast_after must record it.
bool fast_event(PyObject* op, PyObject* args, PyObject* out, int64_t t0, int64_t t1,
                PyObject* names) {
  if (g_fast_rec == nullptr || g_fast_event_ops == nullptr || !fast_type(out) ||
      PySet_Contains(g_fast_event_ops, op) != 1)
    return false;
  PyObject* group = PyObject_GetAttr(g_fast_rec, g_fn->group);
  PyObject* state = PyObject_GetAttr(g_fast_rec, g_fn->native_state);
  PyObject* events = PyObject_GetAttr(g_fast_rec, g_fn->events);
  const long long dropped = attr_ll(g_fast_rec, g_fn->dropped);
  PyObject* step = PyObject_GetAttr(g_fast_rec, g_fn->step_index);
  PyObject* inopt = PyObject_GetAttr(g_fast_rec, g_fn->in_optimizer);
  PyObject* found = nullptr;
  bool usable = group == Py_None && state != nullptr && state != Py_None && events != nullptr &&
                PyList_Check(events) && step != nullptr && inopt != nullptr && !PyErr_Occurred();
  if (usable) {
    PyObject* seq = PyLong_FromLongLong(PyList_GET_SIZE(events) + dropped);
    PyObject* t0o = PyLong_FromLongLong(t0);
    PyObject* t1o = PyLong_FromLongLong(t1);
    PyObject* src = PyTuple_GET_ITEM(args, 0);
    if (seq != nullptr && t0o != nullptr && t1o != nullptr) {
      PyObject* argv[11] = {state, op, src, out, Py_None, seq, t0o, t1o, names, step, inopt};
      found = record(nullptr, argv, 11);
    }
    Py_XDECREF(seq);
    Py_XDECREF(t0o);
    Py_XDECREF(t1o);
  }
  Py_XDECREF(group);
  Py_XDECREF(state);
  Py_XDECREF(step);
  Py_XDECREF(inopt);
  if (PyErr_Occurred() || (usable && found == nullptr)) {
    Py_XDECREF(found);
    Py_XDECREF(events);
    PyErr_Clear();
    return false;  // the Python path records it (and counts what fails there)
  }
  if (found == nullptr || found == Py_None || found == Py_False) {
    Py_XDECREF(events);
    const bool none = found == Py_False;  // no event (an integer index's view)
    Py_XDECREF(found);
    return none;
  }
  PyObject* src = PyTuple_GET_ITEM(args, 0);
  PyObject* ev = PyTuple_GET_ITEM(found, 0);
  PyObject* grad_fn = PyTuple_GET_ITEM(found, 1);
  PyObject* placed = PyTuple_GET_ITEM(found, 2);
  bool done = placed == Py_True && fast_finish(op, src, out, ev, grad_fn);
  if (PyErr_Occurred()) swallow();
  if (!done && g_fast_tail != nullptr) {
    PyObject* r = PyObject_CallFunctionObjArgs(g_fast_tail, op, src, out, ev, grad_fn, placed,
                                               nullptr);
    if (r == nullptr) swallow(); else Py_DECREF(r);
  }
  Py_DECREF(found);
  check_full(events);  // the list the event went to (usable: a list)
  Py_DECREF(events);
  if (!add_ll(g_fast_rec, g_fn->overhead_ns, now_ns() - t1)) swallow();
  return true;
}

// A backward entry point (Tensor.backward, torch.autograd.backward/grad) on one tensor while
// no .data write or rebinding is pending: Watch.check_backward reduced to what it does then,
// noting the root's sequence number (Watch._note_backward). True when done.
PyObject* g_backward_op = nullptr;
PyObject* g_backward_seq = nullptr;
PyObject* g_writes = nullptr;
PyObject* g_rebinds = nullptr;

bool fast_backward(PyObject* op, PyObject* args) {
  if (g_fast_watch == nullptr || op != g_backward_op || PyTuple_GET_SIZE(args) == 0)
    return false;
  for (PyObject* name : {g_writes, g_rebinds}) {
    PyObject* pending = PyObject_GetAttr(g_fast_watch, name);
    const int busy = pending != nullptr ? PyObject_IsTrue(pending) : -1;
    Py_XDECREF(pending);
    if (busy != 0) {
      PyErr_Clear();
      return false;
    }
  }
  // read only now: grad_fn() may regenerate a view's node
  long long seq = -2;  // stays -2 for what is not a tensor
  if (!grad_fn_sequence_nr(PyTuple_GET_ITEM(args, 0), &seq) || seq == -2) return false;
  if (seq == -1) return true;  // no grad_fn
  const long long seen = attr_ll(g_fast_watch, g_backward_seq);
  if (seen == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (seq > seen) {
    PyObject* value = PyLong_FromLongLong(seq);
    if (value == nullptr || PyObject_SetAttr(g_fast_watch, g_backward_seq, value) < 0) swallow();
    Py_XDECREF(value);
  }
  return true;
}

// Run `func` with the aten ops it causes folded and its host times taken, then hand the call
// to after(*lead, result or None, error type or None, t0, t1, folded aten names) with torch
// function handling off; with `fast_op`, fast_event may record it in C instead. The call's
// result or exception is returned as is.
PyObject* run_folded(PyObject* func, PyObject* args, PyObject* kwargs, PyObject* after,
                     std::initializer_list<PyObject*> lead, PyObject* fast_op) {
  tls_fold.size = 0;
  tls_folding = true;
  const int64_t t0 = now_ns();
  PyObject* result = call_through(func, args, kwargs);
  const int64_t t1 = now_ns();
  tls_folding = false;
  PyObject *etype = nullptr, *evalue = nullptr, *etb = nullptr;
  if (result == nullptr) PyErr_Fetch(&etype, &evalue, &etb);
  PyObject* names = fold_names();
  if (fast_op != nullptr && result != nullptr && names != nullptr) {
    NoTorchFunction guard;
    if (fast_event(fast_op, args, result, t0, t1, names)) {
      Py_DECREF(names);
      return result;
    }
  }
  PyObject* t0o = PyLong_FromLongLong(t0);
  PyObject* t1o = PyLong_FromLongLong(t1);
  if (names != nullptr && t0o != nullptr && t1o != nullptr) {
    NoTorchFunction guard;
    PyObject* argv[8];
    size_t n = 0;
    for (PyObject* a : lead) argv[n++] = a;
    argv[n++] = result != nullptr ? result : Py_None;
    argv[n++] = etype != nullptr ? etype : Py_None;
    argv[n++] = t0o;
    argv[n++] = t1o;
    argv[n++] = names;
    PyObject* r = PyObject_Vectorcall(after, argv, n, nullptr);
    if (r == nullptr) swallow(); else Py_DECREF(r);
  } else {
    swallow();
  }
  Py_XDECREF(names);
  Py_XDECREF(t0o);
  Py_XDECREF(t1o);
  if (result == nullptr) PyErr_Restore(etype, evalue, etb);
  return result;
}

inline void call_hook(PyObject* hook, PyObject* func, PyObject* args, PyObject* kwargs) {
  NoTorchFunction guard;
  PyObject* r = PyObject_CallFunctionObjArgs(hook, func, args, kwargs, nullptr);
  if (r == nullptr) swallow(); else Py_DECREF(r);
}

PyObject* torch_function(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs < 3) {
    PyErr_SetString(PyExc_TypeError, "__torch_function__(func, types, args=(), kwargs=None)");
    return nullptr;
  }
  PyObject* func = argv[0];
  PyObject* args = argv[2];
  PyObject* kwargs = nargs > 3 ? argv[3] : Py_None;
  PyObject* owned_args = nullptr;
  if (!PyTuple_Check(args)) {
    owned_args = PySequence_Tuple(args);
    if (owned_args == nullptr) return nullptr;
    args = owned_args;
  }
  struct Drop { PyObject* p; ~Drop() { Py_XDECREF(p); } } drop{owned_args};
  if (tls_folding || g_table == nullptr) return call_through(func, args, kwargs);
  if (PyFunction_Check(func)) {
    // A Python-level torch function (F.softmax, Tensor.backward...) re-entered through
    // handle_torch_function: remember that frame while it runs (see warn_shim.cpp).
    const size_t depth = tls_entry_frames.size;
    push(tls_entry_frames, reinterpret_cast<PyObject*>(PyEval_GetFrame()));  // borrowed
    PyObject* r = call_through_recorded(func, args, kwargs, false);
    tls_entry_frames.size = depth;
    return r;
  }
  return call_through_recorded(func, args, kwargs, false);
}

PyMethodDef g_tf_def = {"torch_function", reinterpret_cast<PyCFunction>(
                            reinterpret_cast<void (*)()>(&torch_function)),
                        METH_FASTCALL, "copytrace's __torch_function__ (see api_mode.cpp)"};

}  // namespace

PyObject* call_through_recorded(PyObject* func, PyObject* args, PyObject* kwargs, bool lean) {
  if (kwargs == nullptr) kwargs = Py_None;  // the hooks take kwargs as an argument
  if (g_watch_writes.load(std::memory_order_relaxed) && g_write_hook != nullptr)
    call_hook(g_write_hook, func, args, kwargs);
  if (copy_hook_wanted(args)) call_hook(g_copy_hook, func, args, kwargs);
  if (func == g_getitem && basic_index(args)) return call_through(func, args, kwargs);
  PyObject* op = PyDict_GetItemWithError(g_table, func);  // borrowed
  if (op == nullptr) {
    if (PyErr_Occurred()) PyErr_Clear();  // an unhashable callable
    return call_through(func, args, kwargs);
  }
  return call_op_recorded(op, func, args, kwargs, lean);
}

PyObject* call_op_recorded(PyObject* op, PyObject* func, PyObject* args, PyObject* kwargs,
                           bool lean) {
  if (kwargs == nullptr) kwargs = Py_None;
  if (lean && in_quiet_code()) return call_through(func, args, kwargs);
  if ((kwargs == Py_None || (PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) == 0)) &&
      fast_backward(op, args))
    return call_through(func, args, kwargs);
  if (g_fast_after != nullptr && fast_call(op, args, kwargs))
    return run_folded(func, args, kwargs, g_fast_after, {op, args}, op);
  PyObject* token;
  {
    NoTorchFunction guard;
    token = PyObject_CallFunctionObjArgs(g_before, op, func, args, kwargs, nullptr);
  }
  if (token == nullptr) {
    swallow();
    return call_through(func, args, kwargs);
  }
  if (token == Py_None) {
    Py_DECREF(token);
    return call_through(func, args, kwargs);
  }
  PyObject* result = run_folded(func, args, kwargs, g_after, {token}, nullptr);
  Py_DECREF(token);
  return result;
}

PyObject* py_set_api_hooks(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "set_api_hooks(table, before, after, write_hook)")) return nullptr;
  set_slot(g_table, argv[0]);
  set_slot(g_before, argv[1]);
  set_slot(g_after, argv[2]);
  set_slot(g_write_hook, argv[3]);
  Py_RETURN_NONE;
}

PyObject* py_set_fast_events(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "set_fast_events(rec, copies, tail, ops)")) return nullptr;
  if (g_fn == nullptr) g_fn = new FastNames();
  if (g_backward_op == nullptr) {
    g_backward_op = intern_name("backward");
    g_backward_seq = intern_name("_backward_seq");
    g_writes = intern_name("writes");
    g_rebinds = intern_name("rebinds");
  }
  PyObject* rec = argv[0];
  Py_CLEAR(g_fast_watch);
  if (rec != Py_None) g_fast_watch = PyObject_GetAttrString(rec, "watch");
  if (PyErr_Occurred()) PyErr_Clear();
  set_slot(g_fast_rec, rec);
  set_slot(g_fast_copies, argv[1]);
  set_slot(g_fast_tail, argv[2]);
  set_slot(g_fast_event_ops, argv[3]);
  Py_RETURN_NONE;
}

PyObject* py_set_fast_api(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "set_fast_api(ops, types, after)")) return nullptr;
  set_slot(g_fast_ops, argv[0]);
  set_slot(g_fast_types, argv[1]);
  set_slot(g_fast_after, argv[2]);
  Py_RETURN_NONE;
}

PyObject* py_set_watch_writes(PyObject*, PyObject* on) {
  const int v = PyObject_IsTrue(on);
  if (v < 0) return nullptr;
  g_watch_writes.store(v == 1);
  Py_RETURN_NONE;
}

PyObject* py_set_copy_hooks(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "set_copy_hooks(fresh, written, hook, getitem)")) return nullptr;
  set_slot(g_fresh, argv[0]);
  set_slot(g_written, argv[1]);
  set_slot(g_copy_hook, argv[2]);
  set_slot(g_getitem, argv[3]);
  Py_RETURN_NONE;
}

// torch requires the handler's __self__ to be the mode object (python_arg_parser.cpp)
PyObject* py_bind_torch_function(PyObject*, PyObject* mode) {
  return PyCFunction_New(&g_tf_def, mode);
}

PyObject* py_entry_frames(PyObject*, PyObject*) {
  PyObject* frames = PyTuple_New(static_cast<Py_ssize_t>(tls_entry_frames.size));
  if (frames == nullptr) return nullptr;
  for (size_t i = 0; i < tls_entry_frames.size; ++i)
    PyTuple_SET_ITEM(frames, static_cast<Py_ssize_t>(i), Py_NewRef(tls_entry_frames.data[i]));
  return frames;
}

PyObject* py_has_entry_frames(PyObject*, PyObject*) {
  return Py_NewRef(tls_entry_frames.size != 0 ? Py_True : Py_False);
}

}  // namespace copytrace
