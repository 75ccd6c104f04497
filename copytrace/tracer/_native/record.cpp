// record(state, op, src, out, src_requires_grad, seq, start, end, aten, step, in_optimizer):
// the common case of Recorder._record_api (copytrace/tracer/_recorder.py) in one call: a new
// event with its tensor facts, call site and storage ids, for an API call on plain tensors that
// did not raise (the caller leaves numpy, deepcopy and calls inside a deepcopy group to
// Python). state: (prototype event, Watch.ids (StorageIds), call-site classify,
// Module._call_impl's code, the recorder's thread names by ident). Returns (event, result's
// grad_fn or None, where): where is True when the event's phase, module and thread are set too
// (outside backward, no module call in progress, a thread named before), else the innermost
// Module._call_impl frame or None for Recorder._place; False when the call is no event (a
// zero-dim integer index: a view); None when a tensor is not a plain one, or before
// record_setup (the caller records it with the Python readers). Sets exactly the fields the
// Python path sets, in the same order of storage ids (input, then result).
//
// The event's field table is the schema's: record_setup(fields) hands over the schema's field
// names (copytrace/tracer/_native/__init__.py reads them); the fields this unit writes
// (RECORD_FIELDS) must all be among them, and their slots are found by name in the event's
// class. The decision itself is the rule table's, copytrace.tracer._rules.RULES, handed over by
// set_record_rules(rules) and resolved there once into C globals (the hot path reads no
// attribute of it and builds no key): always_alias, writes_into and view_is_no_event as
// frozensets, host_device as a str, transfers as four results indexed by (source on host,
// result on host), and, for api_mode.cpp's fast_finish, the watched and not-fresh op sets.
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <structmember.h>

#include <cstring>

#include "observer.h"

// The fields record writes (each spelled once, as its name in the schema).
#define COPYTRACE_RECORD_FIELDS(X)                                                           \
  X(seq) X(op) X(aten) X(bytes_allocated) X(bytes_logical) X(alias) X(noop) X(shape)       \
  X(dtype) X(src_dtype) X(src_device) X(dst_device) X(transfer) X(requires_grad)           \
  X(src_requires_grad) X(grad_fn) X(is_leaf) X(graph) X(step) X(file) X(line) X(function)  \
  X(via) X(start_ns) X(end_ns) X(pinned) X(src_storage) X(src_offset) X(src_stride)        \
  X(src_version) X(dst_storage) X(dst_version) X(fake) X(phase) X(thread_id) X(thread_name) \
  X(lib_file) X(lib_line) X(lib_function)

namespace copytrace {
namespace {

enum Field : int {
#define COPYTRACE_FIELD_ENUM(name) F_##name,
  COPYTRACE_RECORD_FIELDS(COPYTRACE_FIELD_ENUM)
#undef COPYTRACE_FIELD_ENUM
  F_COUNT
};
const char* const kFieldNames[F_COUNT] = {
#define COPYTRACE_FIELD_NAME(name) #name,
    COPYTRACE_RECORD_FIELDS(COPYTRACE_FIELD_NAME)
#undef COPYTRACE_FIELD_NAME
};

PyTypeObject* g_event_type = nullptr;  // the type g_offsets belong to (borrowed, compared only)
Py_ssize_t g_offsets[F_COUNT];
bool g_schema_checked = false;  // record_setup found every field of ours in the schema's
// interned strings: op names compared, values stored, attribute names read
PyObject *s_attached, *s_detached, *s_none, *s_ids, *s_next, *s_limit, *s_of_storage, *s_is_pinned,
    *s_optimizer, *s_other, *s_name;

// RULES, resolved by set_record_rules (all null: no rules, record leaves every call to Python)
PyObject* g_rules = nullptr;  // (RULES, the four transfers): owns what the items below borrow
PyObject* g_always_alias = nullptr;   // frozenset: ops whose result is an alias
PyObject* g_writes_into = nullptr;    // frozenset: ops that write into their first argument
PyObject* g_view_no_event = nullptr;  // frozenset: ops whose alias result is no event
PyObject* g_host_device = nullptr;    // str: the device name of host memory
PyObject* g_transfers[4] = {};        // str by 2 * (source on host) + (result on host)
constexpr int kHostToDevice = 2;      // (True, False): the transfer whose source's pinning is read

bool interned_names() {
  if (s_attached != nullptr) return true;
  struct { PyObject** slot; const char* text; } names[] = {
      {&s_attached, "attached"}, {&s_detached, "detached"}, {&s_none, "none"},
      {&s_ids, "_ids"}, {&s_next, "_next"},
      {&s_limit, "_limit"}, {&s_of_storage, "of_storage"}, {&s_is_pinned, "is_pinned"},
      {&s_optimizer, "optimizer"}, {&s_other, "other"}, {&s_name, "name"}};
  for (auto& n : names) {
    *n.slot = PyUnicode_InternFromString(n.text);
    if (*n.slot == nullptr) return false;
  }
  return true;
}

// The slots of the event class: found by name once per class.
bool event_type_setup(PyTypeObject* type) {
  if (type == g_event_type) return true;
  if (type->tp_members == nullptr || type->tp_dictoffset != 0) {
    PyErr_SetString(PyExc_TypeError, "record: the prototype's class must have __slots__");
    return false;
  }
  for (int f = 0; f < F_COUNT; ++f) {
    g_offsets[f] = -1;
    for (PyMemberDef* m = type->tp_members; m->name != nullptr; ++m) {
      if (m->type == T_OBJECT_EX && std::strcmp(m->name, kFieldNames[f]) == 0) {
        g_offsets[f] = m->offset;
        break;
      }
    }
    if (g_offsets[f] < 0) {
      PyErr_Format(PyExc_TypeError, "record: the event has no field %s", kFieldNames[f]);
      return false;
    }
  }
  g_event_type = type;
  return true;
}

// Store `value` (a new reference, may be NULL after an error: then false) in field f of ev.
inline bool put(PyObject* ev, Field f, PyObject* value) {
  if (value == nullptr) return false;
  PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(ev) + g_offsets[f]);
  PyObject* old = *slot;
  *slot = value;
  Py_XDECREF(old);
  return true;
}

inline bool on_host(PyObject* device) {
  return device == g_host_device || PyUnicode_Compare(device, g_host_device) == 0;
}

// _rules._transfer(src, dst) for two device names (borrowed; null: an error set), and in
// *host_to_device whether it is the (True, False) entry: the source's pinning is read then.
PyObject* transfer_of(PyObject* src, PyObject* dst, bool* host_to_device) {
  *host_to_device = false;
  const int same = PyUnicode_Compare(src, dst);
  if (same == -1 && PyErr_Occurred()) return nullptr;
  if (same == 0) return s_none;
  const int key = 2 * on_host(src) + on_host(dst);
  if (PyErr_Occurred()) return nullptr;
  *host_to_device = key == kHostToDevice;
  return g_transfers[key];
}

// StorageIds.of_storage(key) (copytrace/tracer/watch/_ids.py) for `key`, a StorageImpl's
// address (Facts.storage) or None: its dict read and its insert in C (an entry holds torch's
// weak handle on the StorageImpl, so no other storage gets its address while it is listed);
// a full table (to be pruned) goes to the Python method.
PyObject* storage_id(PyObject* ids, PyObject* key) {
  if (key == Py_None) Py_RETURN_NONE;
  PyObject* table = PyObject_GetAttr(ids, s_ids);
  if (table == nullptr) return nullptr;
  if (!PyDict_Check(table) || !PyLong_CheckExact(key)) {
    Py_DECREF(table);
    return PyObject_CallMethodOneArg(ids, s_of_storage, key);
  }
  PyObject* entry = PyDict_GetItemWithError(table, key);  // borrowed
  if (entry != nullptr) {
    Py_DECREF(table);
    return Py_NewRef(entry);
  }
  PyObject* result = nullptr;
  PyObject* limit = PyErr_Occurred() ? nullptr : PyObject_GetAttr(ids, s_limit);
  PyObject* uid = limit == nullptr ? nullptr : PyObject_GetAttr(ids, s_next);
  if (uid != nullptr) {
    const Py_ssize_t size = PyDict_GET_SIZE(table);
    const long long lim = PyLong_AsLongLong(limit);
    if (lim == -1 && PyErr_Occurred()) {
      // result stays NULL
    } else if (size >= lim) {
      result = PyObject_CallMethodOneArg(ids, s_of_storage, key);  // prunes the table
    } else {
      auto* impl = static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(key));
      PyObject* one = PyLong_FromLong(1);
      PyObject* next = one == nullptr ? nullptr : PyNumber_Add(uid, one);
      Py_XDECREF(one);
      if (next != nullptr && impl != nullptr && PyObject_SetAttr(ids, s_next, next) == 0 &&
          PyDict_SetItem(table, key, uid) == 0) {
        // torch's weak handle (UntypedStorage._weak_ref: make_weak; its address, the key)
        (void)c10::raw::intrusive_ptr::make_weak(impl);
        result = Py_NewRef(uid);
      }
      Py_XDECREF(next);
    }
  }
  Py_XDECREF(uid);
  Py_XDECREF(limit);
  Py_DECREF(table);
  return result;
}

}  // namespace

PyObject* record(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 11 || !PyTuple_Check(argv[0]) || PyTuple_GET_SIZE(argv[0]) != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "record(state, op, src, out, src_requires_grad, seq, start, end, aten, step, "
                    "in_optimizer)");
    return nullptr;
  }
  if (!g_schema_checked || g_rules == nullptr) Py_RETURN_NONE;  // before the set-up
  PyObject* state = argv[0];
  PyObject *op = argv[1], *src = argv[2], *out = argv[3], *src_rg_arg = argv[4];
  PyObject* proto = PyTuple_GET_ITEM(state, 0);
  PyObject* ids = PyTuple_GET_ITEM(state, 1);
  if (!THPVariable_CheckExact(src) || !THPVariable_CheckExact(out)) Py_RETURN_NONE;
  if (!event_type_setup(Py_TYPE(proto))) return nullptr;
  // The facts of both tensors, read in place (no Facts tuple): released at return.
  struct Facts {
    // zeroed: when the source has no plain-tensor facts the result's are never read
    PyObject* items[FACT_COUNT] = {};
    ~Facts() { for (PyObject* o : items) Py_XDECREF(o); }
  } fs, fo;
  // only the facts read below: the source's shape and byte counts, the result's offset and
  // stride are no field of the event
  constexpr unsigned kSrcFacts = kAllFacts & ~((1u << FACT_shape) | (1u << FACT_storage_bytes) |
                                               (1u << FACT_logical_bytes));
  constexpr unsigned kOutFacts = kAllFacts & ~((1u << FACT_offset) | (1u << FACT_stride));
  if (read_facts(src, false, fs.items, kSrcFacts) != 1 ||
      read_facts(out, true, fo.items, kOutFacts) != 1)
    Py_RETURN_NONE;
  auto S = [&](Fact i) { return fs.items[i]; };
  auto O = [&](Fact i) { return fo.items[i]; };
  PyObject* ev = copy_slots(nullptr, proto);
  if (ev == nullptr) return nullptr;
  struct Drop { PyObject* o; ~Drop() { Py_DECREF(o); } } drop{ev};
  auto R = [](PyObject* o) { return Py_NewRef(o); };
  bool ok = put(ev, F_op, R(op)) && put(ev, F_aten, R(argv[8])) && put(ev, F_seq, R(argv[5])) &&
            put(ev, F_start_ns, R(argv[6])) && put(ev, F_end_ns, R(argv[7]));
  PyObject* src_device = S(FACT_device);
  PyObject* src_rg = src_rg_arg == Py_None ? S(FACT_requires_grad) : src_rg_arg;
  PyObject* dst_device = O(FACT_device);
  PyObject* rg = O(FACT_requires_grad);
  PyObject* grad_fn = O(FACT_grad_fn);
  ok = ok && put(ev, F_src_dtype, R(S(FACT_dtype))) && put(ev, F_src_device, R(src_device)) &&
       put(ev, F_src_requires_grad, R(src_rg)) && put(ev, F_shape, R(O(FACT_shape))) &&
       put(ev, F_dtype, R(O(FACT_dtype))) && put(ev, F_dst_device, R(dst_device)) &&
       put(ev, F_bytes_logical, R(O(FACT_logical_bytes))) && put(ev, F_requires_grad, R(rg)) &&
       put(ev, F_grad_fn, R(O(FACT_grad_fn_name))) && put(ev, F_is_leaf, R(O(FACT_is_leaf)));
  if (!ok) return nullptr;
  bool noop = false, alias = false;
  const int writes_into = PySet_Contains(g_writes_into, op);
  if (writes_into < 0) return nullptr;
  if (writes_into == 1) {
    alias = false;  // written into an existing tensor: 0 bytes allocated
  } else if (out == src) {
    noop = alias = true;
    ok = put(ev, F_noop, R(Py_True)) && put(ev, F_alias, R(Py_True));
  } else {
    const int always = PySet_Contains(g_always_alias, op);
    if (always < 0) return nullptr;
    if (always == 1) {
      alias = true;
    } else {
      // both StorageImpl addresses (read_facts): the same one, the same storage
      alias = PyLong_AsVoidPtr(O(FACT_storage)) == PyLong_AsVoidPtr(S(FACT_storage));
    }
    ok = put(ev, F_alias, R(alias ? Py_True : Py_False));
    if (ok && !alias) {
      if (O(FACT_fake) == Py_True) {
        ok = put(ev, F_fake, R(Py_True));  // a copy of no real memory: logical bytes only
      } else {
        ok = put(ev, F_bytes_allocated, R(O(FACT_storage_bytes)));
      }
    }
  }
  if (!ok) return nullptr;
  if (grad_fn != Py_None || (noop && rg == Py_True)) {
    ok = put(ev, F_graph, R(s_attached));
  } else if (src_rg == Py_True) {
    ok = put(ev, F_graph, R(s_detached));
  }
  if (!ok) return nullptr;
  if (alias) {
    const int no_event = PySet_Contains(g_view_no_event, op);
    if (no_event < 0) return nullptr;
    if (no_event == 1) Py_RETURN_FALSE;  // a zero-dim integer index: a view
  }
  if (src_device != dst_device) {  // interned names: equal names are one object
    bool host_to_device;
    PyObject* transfer = transfer_of(src_device, dst_device, &host_to_device);
    if (transfer == nullptr || !put(ev, F_transfer, R(transfer))) return nullptr;
    if (host_to_device) {
      PyObject* pinned = PyObject_CallMethodNoArgs(src, s_is_pinned);
      if (!put(ev, F_pinned, pinned)) return nullptr;
    }
  }
  // Recorder._context's call site
  PyObject* classify = PyTuple_GET_ITEM(state, 2);
  PyObject* site = call_site(nullptr, &classify, 1);
  if (site == nullptr) return nullptr;
  if (site != Py_None) {
    ok = put(ev, F_file, R(PyTuple_GET_ITEM(site, 0))) &&
         put(ev, F_line, R(PyTuple_GET_ITEM(site, 1))) &&
         put(ev, F_function, R(PyTuple_GET_ITEM(site, 2))) &&
         put(ev, F_via, R(PyTuple_GET_ITEM(site, 3)));
    PyObject* lib = PyTuple_GET_ITEM(site, 4);
    if (ok && lib != Py_None) {
      ok = put(ev, F_lib_file, R(PyTuple_GET_ITEM(lib, 0))) &&
           put(ev, F_lib_line, R(PyTuple_GET_ITEM(lib, 1))) &&
           put(ev, F_lib_function, R(PyTuple_GET_ITEM(lib, 2)));
    }
  }
  Py_DECREF(site);
  if (!ok || !put(ev, F_step, R(argv[9]))) return nullptr;
  // Watch._event's storage facts
  PyObject* sid = storage_id(ids, S(FACT_storage));
  if (!put(ev, F_src_storage, sid)) return nullptr;
  if (S(FACT_offset) != Py_None) {
    ok = put(ev, F_src_offset, R(S(FACT_offset))) && put(ev, F_src_stride, R(S(FACT_stride))) &&
         put(ev, F_src_version, R(S(FACT_version)));
  }
  if (ok) {
    ok = put(ev, F_dst_storage, out == src ? R(sid) : storage_id(ids, O(FACT_storage))) &&
         put(ev, F_dst_version, R(O(FACT_version)));
  }
  if (!ok) return nullptr;
  PyObject* frame = innermost_frame_of(PyTuple_GET_ITEM(state, 3));
  if (frame == nullptr) return nullptr;
  if (frame == Py_None && torch::autograd::get_current_graph_task_id() < 0) {
    // Recorder._place's common case: not in backward, no module call: module None
    PyObject* ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (ident == nullptr) {
      Py_DECREF(frame);
      return nullptr;
    }
    // this thread's name, where Python's Recorder._place read it (a _thread._local: gone
    // with the thread, so a later thread with the same ident does not take it)
    PyObject* name = PyObject_GetAttr(PyTuple_GET_ITEM(state, 4), s_name);
    if (name == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
    if (name != nullptr) {
      const int optimizer = PyObject_IsTrue(argv[10]);
      if (optimizer < 0 || !put(ev, F_phase, R(optimizer ? s_optimizer : s_other))) {
        Py_DECREF(name);
        Py_DECREF(ident);
        Py_DECREF(frame);
        return nullptr;
      }
      put(ev, F_thread_name, name);  // takes the reference
      put(ev, F_thread_id, ident);  // takes the reference
      ident = nullptr;
      Py_DECREF(frame);
      frame = Py_NewRef(Py_True);
    }
    Py_XDECREF(ident);
    if (PyErr_Occurred()) {
      Py_DECREF(frame);
      return nullptr;
    }
  }
  PyObject* result = PyTuple_New(3);
  if (result == nullptr) {
    Py_DECREF(frame);
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 0, R(ev));
  PyTuple_SET_ITEM(result, 1, R(grad_fn));
  PyTuple_SET_ITEM(result, 2, frame);
  return result;
}


PyObject* g_rule_watched = nullptr;
PyObject* g_rule_not_fresh = nullptr;
PyObject* g_rule_alias_watched = nullptr;  // RULES.alias_watched (absent: null)

// record_setup(fields): the schema's event field names (a sequence of str). ValueError naming a
// field this unit writes that the schema does not have.
PyObject* py_record_setup(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 1, "record_setup(fields)")) return nullptr;
  if (!interned_names()) return nullptr;
  PyObject* fields = PySequence_Fast(argv[0], "record_setup: fields must be a sequence");
  if (fields == nullptr) return nullptr;
  g_schema_checked = false;
  for (int f = 0; f < F_COUNT; ++f) {
    bool found = false;
    for (Py_ssize_t i = 0; !found && i < PySequence_Fast_GET_SIZE(fields); ++i) {
      PyObject* name = PySequence_Fast_GET_ITEM(fields, i);
      found = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, kFieldNames[f]) == 0;
    }
    if (!found) {
      Py_DECREF(fields);
      PyErr_Format(PyExc_ValueError, "record_setup: the schema has no event field %s",
                   kFieldNames[f]);
      return nullptr;
    }
  }
  Py_DECREF(fields);
  g_schema_checked = true;
  Py_RETURN_NONE;
}

namespace {

// rules[index] (borrowed) if it is a frozenset (want_set) or a str; else null, TypeError set.
PyObject* rule_item(PyObject* rules, Py_ssize_t index, bool want_set) {
  PyObject* item = PyTuple_GET_ITEM(rules, index);
  if (want_set ? PyFrozenSet_Check(item) : PyUnicode_Check(item)) return item;
  PyErr_Format(PyExc_TypeError, "set_record_rules: rules[%zd] must be a %s", index,
               want_set ? "frozenset" : "str");
  return nullptr;
}

}  // namespace

// set_record_rules(rules): copytrace.tracer._rules.RULES (a RecordRules tuple; None clears):
// its items resolved here once. TypeError where an item is not of its type; KeyError where
// transfers lacks one of its four keys.
PyObject* py_set_record_rules(PyObject*, PyObject* rules) {
  if (!interned_names()) return nullptr;
  if (rules == Py_None) {
    PyObject* old = g_rules;
    g_rules = nullptr;  // record and fast_finish read no item from here on
    for (PyObject** slot : {&g_always_alias, &g_writes_into, &g_view_no_event, &g_host_device,
                            &g_rule_watched, &g_rule_not_fresh, &g_rule_alias_watched})
      *slot = nullptr;
    for (PyObject*& t : g_transfers) t = nullptr;
    Py_XDECREF(old);
    Py_RETURN_NONE;
  }
  // RecordRules' order: always_alias, writes_into, view_is_no_event, host_device, transfers,
  // watched, not_fresh
  if (!PyTuple_Check(rules) || PyTuple_GET_SIZE(rules) < 7 ||
      !PyDict_Check(PyTuple_GET_ITEM(rules, 4))) {
    PyErr_SetString(PyExc_TypeError, "set_record_rules: rules must be a RecordRules");
    return nullptr;
  }
  PyObject* sets[6] = {rule_item(rules, 0, true), rule_item(rules, 1, true),
                       rule_item(rules, 2, true), rule_item(rules, 3, false),
                       rule_item(rules, 5, true), rule_item(rules, 6, true)};
  for (PyObject* item : sets)
    if (item == nullptr) return nullptr;
  // alias_watched (index 8) is optional: a rule table without it watches no alias result
  PyObject* alias_watched = PyTuple_GET_SIZE(rules) > 8 ? rule_item(rules, 8, true) : Py_None;
  if (alias_watched == nullptr) return nullptr;
  PyObject* transfers[4];
  for (int key = 0; key < 4; ++key) {
    PyObject* pair = PyTuple_Pack(2, key & 2 ? Py_True : Py_False, key & 1 ? Py_True : Py_False);
    if (pair == nullptr) return nullptr;
    transfers[key] = PyDict_GetItemWithError(PyTuple_GET_ITEM(rules, 4), pair);  // borrowed
    if (transfers[key] == nullptr && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, pair);
    Py_DECREF(pair);
    if (transfers[key] == nullptr) return nullptr;
    if (!PyUnicode_Check(transfers[key])) {
      PyErr_SetString(PyExc_TypeError, "set_record_rules: a transfer must be a str");
      return nullptr;
    }
  }
  // The items are borrowed: the tuple (immutable) and the four results are kept, so that a
  // later change to the RULES.transfers dict cannot free a result record still uses.
  PyObject* kept = Py_BuildValue("(O(OOOO))", rules, transfers[0], transfers[1], transfers[2],
                                 transfers[3]);
  if (kept == nullptr) return nullptr;
  PyObject* old = g_rules;
  g_rules = nullptr;  // (one thread holds the GIL here: record never sees a half set-up)
  g_always_alias = sets[0];
  g_writes_into = sets[1];
  g_view_no_event = sets[2];
  g_host_device = sets[3];
  g_rule_watched = sets[4];
  g_rule_not_fresh = sets[5];
  g_rule_alias_watched = alias_watched == Py_None ? nullptr : alias_watched;
  for (int key = 0; key < 4; ++key) g_transfers[key] = transfers[key];
  g_rules = kept;
  Py_XDECREF(old);
  Py_RETURN_NONE;
}

// RECORD_FIELDS: the event fields record writes, in the order it knows them.
bool record_init(PyObject* module) {
  PyObject* names = PyTuple_New(F_COUNT);
  if (names == nullptr) return false;
  for (int f = 0; f < F_COUNT; ++f) {
    PyObject* name = PyUnicode_InternFromString(kFieldNames[f]);
    if (name == nullptr) {
      Py_DECREF(names);
      return false;
    }
    PyTuple_SET_ITEM(names, f, name);
  }
  const bool ok = PyModule_AddObjectRef(module, "RECORD_FIELDS", names) == 0;
  Py_DECREF(names);
  return ok;
}

}  // namespace copytrace
