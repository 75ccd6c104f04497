// The observer module: its one list of entry points and its init. Every unit's entry points
// are declared in observer.h and typed in observer.pyi. Python only: no torch header.
#include "observer.h"

namespace copytrace {
namespace {

#define FN(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&(f)))

PyMethodDef g_methods[] = {
    // kernels.cpp: the aten level
    {"install", FN(py_install), METH_FASTCALL,
     "install(ops, callback): register the kernels for the (name, overload, kind, display) ops"},
    {"uninstall", py_uninstall, METH_NOARGS, "Deregister every kernel and drop the callback"},
    {"set_enabled", py_set_enabled, METH_O, "Observe (True) or only re-dispatch (False)"},
    {"enabled", py_enabled, METH_NOARGS, "Whether the kernels observe"},
    {"set_owner", py_set_owner, METH_O,
     "Mark the calling thread as the traced one (thread-local)"},
    {"suppress", py_suppress, METH_NOARGS,
     "Enter a region the observer ignores (a compiled call)"},
    {"unsuppress", py_unsuppress, METH_NOARGS, "Leave a region entered by suppress()"},
    {"suppressed", py_suppressed, METH_NOARGS, "The suppress depth on this thread"},
    {"begin_fold", py_begin_fold, METH_NOARGS, "Fold the aten ops seen from now (this thread)"},
    {"end_fold", py_end_fold, METH_NOARGS, "Stop folding; the aten names seen since begin_fold"},
    {"internal_detaches", py_internal_detaches, METH_NOARGS,
     "Autograd's own detach/alias calls since the last call"},
    {"errors", py_errors, METH_NOARGS, "Errors counted in copytrace's hooks since the last call"},
    {"depth", py_depth, METH_NOARGS, "Ops in progress on this thread (debugging)"},
    // api_mode.cpp: the API level
    {"set_api_hooks", FN(py_set_api_hooks), METH_FASTCALL,
     "set_api_hooks(table, before, after, write_hook) (None clears)"},
    {"set_fast_events", FN(py_set_fast_events), METH_FASTCALL,
     "set_fast_events(rec, copies, tail, ops): recorder, its FreshCopies, tail(op, src, out, "
     "ev, grad_fn, placed), op names (None clears)"},
    {"set_fast_api", FN(py_set_fast_api), METH_FASTCALL,
     "set_fast_api(ops, types, after): op names, exact first-argument types, after(op, args, "
     "result, error, t0, t1, aten): the one-call path (None clears)"},
    {"set_watch_writes", py_set_watch_writes, METH_O,
     "Call the write hook for every torch call (True) or not"},
    {"set_copy_hooks", FN(py_set_copy_hooks), METH_FASTCALL,
     "set_copy_hooks(fresh, written, hook, getitem) (None clears)"},
    {"bind_torch_function", py_bind_torch_function, METH_O,
     "The C __torch_function__ bound to `mode` (its __self__)"},
    {"entry_frames", py_entry_frames, METH_NOARGS,
     "handle_torch_function frames copytrace's mode re-entered from, on this thread"},
    {"has_entry_frames", py_has_entry_frames, METH_NOARGS, "Whether entry_frames() is not empty"},
    // warn_shim.cpp
    {"make_warn", py_make_warn, METH_O,
     "A warnings.warn that calls `orig` with the stacklevel counted as untraced"},
    // versions.cpp
    {"version_of", version_of, METH_O,
     "version_of(tensor) -> a handle on its version counter, or None"},
    {"version_delta", py_version_delta, METH_O,
     "version_delta(handle) -> bumps of the counter since version_of"},
    {"version_final", py_version_final, METH_O,
     "version_final(handle) -> version_delta once no tensor shares the counter, else None"},
    {"grad_fn_ref", py_grad_fn_ref, METH_O,
     "grad_fn_ref(tensor or C++ node) -> a weak pointer on its grad_fn (the node), or None"},
    {"grad_fn_of", py_grad_fn_of, METH_O, "grad_fn_of(ref) -> the node while it lives, else None"},
    {"grad_fn_alive", py_grad_fn_alive, METH_O, "grad_fn_alive(ref) -> whether the node lives"},
    {"kept_pair", FN(py_kept_pair), METH_FASTCALL,
     "kept_pair(a, b) -> (a, b), untracked by the cycle collector when a and b are"},
    // lean.cpp
    {"wrap_api", FN(py_wrap_api), METH_FASTCALL,
     "wrap_api(name, original, method): a C function named `name` that records calls of "
     "`original` (method: binds as one)"},
    {"data_descriptor", FN(py_data_descriptor), METH_FASTCALL,
     "data_descriptor(original, get, set): a data descriptor for Tensor.data"},
    {"set_wrappers", py_set_wrappers, METH_O, "Record calls through the wrappers (level lean)"},
    {"set_quiet_codes", py_set_quiet_codes, METH_O,
     "Code objects inside which the wrappers record nothing (a set; None clears)"},
    // watch_cb.cpp
    {"watch_tensor", FN(py_watch_tensor), METH_FASTCALL,
     "watch_tensor(tensor, kind) -> key of its version counter (None: none); level lean's "
     "write watch hands the ops on it to the watch hook"},
    {"unwatch", FN(py_unwatch), METH_FASTCALL, "unwatch(key, kind): stop watching it for kind"},
    {"set_watch_hook", py_set_watch_hook, METH_O,
     "set_watch_hook(hook): hook(((key, written, storage address or None), ...)) per outermost op "
     "on a watched tensor (None clears every watch)"},
    {"watched", py_watched, METH_NOARGS, "(watched keys, callback registered) (tests)"},
    // hotpatch.cpp
    {"hot_install", FN(py_hot_install), METH_FASTCALL,
     "hot_install(callables, data, get, set): hot-patch torch's pointers of these callables "
     "and of Tensor.data's getset descriptor (or None): a bool per callable, then one for data"},
    {"hot_restore", py_hot_restore, METH_NOARGS, "Put back every pointer hot_install swapped"},
    {"hot_count", py_hot_count, METH_NOARGS, "How many entries are hot-patched now"},
    // legacy.cpp
    {"legacy_install", FN(py_legacy_install), METH_FASTCALL,
     "legacy_install(op, base, tensor, typed): the tp_new trampolines of the legacy "
     "constructors in base (TensorBase), its subclasses holding its pointer and the typed "
     "types; how many slots were swapped"},
    {"legacy_restore", FN(py_legacy_restore), METH_FASTCALL,
     "legacy_restore(base, typed): the original tp_new wherever a trampoline is; how many"},
    // facts.cpp
    {"facts", FN(py_facts), METH_FASTCALL,
     "facts(t, with_grad_fn=False): a plain tensor's Facts (see copytrace/tracer/_facts.py), "
     "or None"},
    {"sizes_strides_policy", py_sizes_strides_policy, METH_O,
     "sizes_strides_policy(t): 0 torch answers t's sizes and strides, 1 a subclass answers its "
     "strides in Python, 2 its sizes too"},
    {"sizes_default", py_sizes_default, METH_O,
     "sizes_default(t): (shape, numel, storage_offset) as t's TensorImpl holds them, asking no "
     "subclass; None for symbolic sizes or no tensor"},
    {"storage_of", py_storage_of, METH_O,
     "storage_of(t): (address of t's StorageImpl, its bytes or None), or None; makes no "
     "Python storage object"},
    {"storage_hold", py_storage_hold, METH_O,
     "storage_hold(address): take torch's weak handle on the live StorageImpl there "
     "(UntypedStorage._free_weak_ref gives it back); returns the address"},
    {"storage_owners", py_storage_owners, METH_O,
     "storage_owners(address): strong references to the held StorageImpl there, torch's own "
     "Python storage object not counted; 0 once gone"},
    {"copy_slots", copy_slots, METH_O,
     "copy_slots(proto): a shallow copy of a __slots__ object (a new CopyEvent from a "
     "prototype), untracked by the GC"},
    // steps.cpp
    {"set_step_hooks", FN(py_set_step_hooks), METH_FASTCALL,
     "set_step_hooks(begin, end): call them around each optimizer step on this thread (torch's "
     "Optimizer.step# record scope); (None, None) removes them"},
    {"set_step_idle", FN(py_set_step_idle), METH_FASTCALL,
     "set_step_idle(on): count the steps in C without calling the hooks (on), or call them "
     "again (off); returns the steps counted since the last call"},
    {"set_step_code", py_set_step_code, METH_O,
     "set_step_code(code): copytrace's code stands at Optimizer._optimizer_step_code and code "
     "is profile_hook_step's wrapper's (idle counts there, the callback off); None: it does not"},
    {"optimizer_step_seen", py_optimizer_step_seen, METH_NOARGS,
     "optimizer_step_seen(): from Optimizer._optimizer_step_code, after each step(): counted "
     "while idle (see copytrace/tracer/_stepcode.py); raises nothing"},
    // audit.cpp
    {"exec_hook", py_exec_hook, METH_O,
     "exec_hook(on_exec): call on_exec() at each os.exec audit event, from a C audit hook "
     "added once (None: call nothing)"},
    // frames.cpp
    {"call_site", FN(call_site), METH_FASTCALL,
     "call_site(classify): the user's (file, line, function, via, library) or None (see "
     "copytrace/tracer/_callsite.py)"},
    {"clear_sites", py_clear_sites, METH_NOARGS,
     "Drop the call-site caches (and the code objects they hold)"},
    {"frame_var", FN(py_frame_var), METH_FASTCALL,
     "frame_var(frame, name): a frame's variable without f_locals"},
    {"module_calls", FN(py_module_calls), METH_FASTCALL,
     "module_calls(frame, code): the self of each frame running code at or above frame, "
     "outermost first"},
    // record.cpp
    {"record", FN(record), METH_FASTCALL,
     "record(state, op, src, out, src_requires_grad, seq, start, end, aten, step, "
     "in_optimizer): an API call's event as (event, grad_fn, placed or module frame), False or "
     "None (see record.cpp)"},
    {"record_setup", FN(py_record_setup), METH_FASTCALL,
     "record_setup(fields): the schema's event field names"},
    {"set_record_rules", py_set_record_rules, METH_O,
     "set_record_rules(rules): the rule table record and fast_finish follow "
     "(copytrace.tracer._rules.RULES; None clears)"},
    // columns.cpp
    {"event_columns", FN(py_event_columns), METH_FASTCALL,
     "event_columns(events, specs): Arrow column buffers of the records' fields, or None"},
    // otlp.cpp
    {"span_json", FN(py_span_json), METH_FASTCALL,
     "span_json(n, trace, ids, parents, names, starts, ends, attrs, error): the spans' "
     "OTLP/JSON text and its int64 offsets"},
    // attached.cpp
    {"set_attached", FN(py_set_attached), METH_FASTCALL,
     "set_attached(attached_cls, storage_ref_cls, free_weak_ref, storage_owners): the classes "
     "an attached copy's entry is made of in C (None clears)"},
    // compiled.cpp
    {"callback_from_stance", py_callback_from_stance, METH_O,
     "copytrace's torch._dynamo.eval_frame._callback_from_stance"},
    {"cfs_install", FN(py_cfs_install), METH_FASTCALL,
     "cfs_install(orig, state, wrap): orig, Compiled, Compiled._wrapped (None x 3 clears)"},
    {"cfs_begin", py_cfs_begin, METH_O, "the open compiled call's code list, or None"},
    {"compiled_enter", py_compiled_enter, METH_NOARGS,
     "copytrace's enter hook of torch.compile contexts (C path)"},
    {"compiled_backward", FN(py_compiled_backward), METH_FASTCALL,
     "compiled_backward(fn, *args): a compiled graph's backward, observer suppressed"},
    {"user_fn_install", FN(py_user_fn_install), METH_FASTCALL,
     "user_fn_install(orig, partial, run) -> BackwardCFunction._get_user_fn (None x 3 clears)"},
    {"cc_install", FN(py_cc_install), METH_FASTCALL,
     "cc_install(state, rec, raw, code_graphs, graph_runs, module_type, graphs, nothing) (None "
     "clears; returns whether a call was open)"},
    {nullptr, nullptr, 0, nullptr}};

#undef FN

int exec_module(PyObject* module) {
  if (!versions_init(module) || !facts_init(module) || !record_init(module)) return -1;
  return 0;
}

PyModuleDef_Slot g_slots[] = {{Py_mod_exec, reinterpret_cast<void*>(&exec_module)},
                              {0, nullptr}};

}  // namespace
}  // namespace copytrace

#define COPYTRACE_CAT(a, b) a##b
#define COPYTRACE_INIT(name) COPYTRACE_CAT(PyInit_, name)

PyMODINIT_FUNC COPYTRACE_INIT(TORCH_EXTENSION_NAME)() {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT,
                            "copytrace_observer",
                            "copytrace's dispatcher-level copy observer (BackendSelect kernels)",
                            0,
                            copytrace::g_methods,
                            copytrace::g_slots,
                            nullptr,
                            nullptr,
                            nullptr};
  return PyModuleDef_Init(&def);
}
