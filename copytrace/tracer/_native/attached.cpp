// An attached copy's end in C: what Recorder.api_tail (copytrace/tracer/_api_events.py) does
// for a fresh copy with a grad_fn made outside backward and module calls (`x.clone()` of a
// tensor that requires grad), when nothing calls for Python: the grad_fn tagged in NodeTags
// (_node_tags.py), the copy listed as an _Attached entry (watch/_retained.py) with torch's weak
// handle on its storage (a StorageRef, _storage_ref.py) and counted under its call site
// (watch/_accumulate.py, _note_site). The objects made are the Python classes' own (their
// __slots__ filled in place, as copy_slots fills an event), with the values the Python path
// gives them. Any case that would do more (a table due for its prune, a site new, restarted,
// due for its check or flagged, a node that is not a C++ one) is left to Python whole: the
// checks come before anything is changed.
// Python only: the torch facts come from versions.cpp and facts.cpp (node_facts,
// storage_impl_of).
#include "observer.h"

#include <unordered_map>
#include <utility>

namespace copytrace {
namespace {

PyTypeObject* g_attached_type = nullptr;  // watch/_retained.py's _Attached (owned)
PyTypeObject* g_ref_type = nullptr;       // _storage_ref.py's StorageRef (owned)
PyObject* g_ref_free = nullptr;           // UntypedStorage._free_weak_ref
PyObject* g_ref_owners = nullptr;         // storage_owners (this module's)
constexpr Py_ssize_t kMaxAttached = 100000;  // watch/_watch.py's _MAX_ATTACHED

enum AttachedSlot : int { A_node, A_ev, A_seq, A_kind, A_storage, A_pending, A_COUNT };
const char* const kAttachedSlots[A_COUNT] = {"node", "ev", "seq", "kind", "storage", "pending"};
Slots<A_COUNT> g_attached{kAttachedSlots};
enum RefSlot : int { R_cdata, R_free, R_owners, R_COUNT };
const char* const kRefSlots[R_COUNT] = {"cdata", "_free", "_owners"};
Slots<R_COUNT> g_ref{kRefSlots};
// the event's fields read here (schema.CopyEvent) and _Site's slots (watch/_accumulate.py)
enum EventSlot : int { E_transfer, E_file, E_line, E_module, E_COUNT };
const char* const kEventSlots[E_COUNT] = {"transfer", "file", "line", "module"};
Slots<E_COUNT> g_event{kEventSlots};
enum SiteSlot : int { S_count, S_next_check, S_flagged, S_mark, S_last, S_COUNT };
const char* const kSiteSlots[S_COUNT] = {"count", "next_check", "flagged", "mark", "last"};
Slots<S_COUNT> g_site{kSiteSlots};

// "file:line" of a call site (the grad_fn tag's), by file object and line: one string per site
struct SiteHash {
  size_t operator()(const std::pair<PyObject*, long long>& k) const {
    return std::hash<void*>()(k.first) ^ (std::hash<long long>()(k.second) * 31);
  }
};
std::unordered_map<std::pair<PyObject*, long long>, PyObject*, SiteHash> g_where;  // owned
constexpr size_t kMaxWhere = 4096;

// f"{file}:{line}" (a new reference), kept per (file, line) while the file object is held
PyObject* where_of(PyObject* file, PyObject* line) {
  const long long n = PyLong_CheckExact(line) ? PyLong_AsLongLong(line) : -1;
  if (n < 0 || !PyUnicode_CheckExact(file)) {
    PyErr_Clear();
    return PyUnicode_FromFormat("%S:%S", file, line);
  }
  auto found = g_where.find({file, n});
  if (found != g_where.end()) return Py_NewRef(found->second);
  PyObject* where = PyUnicode_FromFormat("%U:%lld", file, n);
  if (where == nullptr) return nullptr;
  if (g_where.size() >= kMaxWhere) {
    for (auto& [key, text] : g_where) {
      Py_DECREF(key.first);
      Py_DECREF(text);
    }
    g_where.clear();
  }
  g_where.emplace(std::make_pair(Py_NewRef(file), n), Py_NewRef(where));
  return where;
}

struct Names {
  PyObject *node_tags, *tags, *limit, *attached, *attached_prune, *sites, *backward_seq, *none;
};
Names* g_names = nullptr;

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) Py_FatalError("copytrace observer: out of memory interning a name");
  return o;
}

// attribute `name` of obj as a long long; false where it is missing or no int (error cleared)
inline bool attr_int(PyObject* obj, PyObject* name, long long* out) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) return false;
  *out = PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
  const bool ok = PyLong_Check(v) && !PyErr_Occurred();
  Py_DECREF(v);
  return ok;
}

// an int slot's value; false where unset or no int (no error left set)
inline bool int_at(PyObject* v, long long* out) {
  if (v == nullptr || !PyLong_Check(v)) return false;
  *out = PyLong_AsLongLong(v);
  if (*out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// Owned references read before anything is changed, released at the end.
struct Held {
  PyObject *tags_obj = nullptr, *tags = nullptr, *attached = nullptr, *sites = nullptr,
           *site = nullptr, *file = nullptr, *line = nullptr, *module = nullptr,
           *ref = nullptr, *leaf_version = nullptr;
  ~Held() {
    for (PyObject* o : {tags_obj, tags, attached, sites, site, file, line, module, ref,
                        leaf_version})
      Py_XDECREF(o);
  }
};

// The checks: 1 when the C path may finish the event (h filled, *count the site's count),
// 0 when Python must (no error set).
int attached_ready(PyObject* rec, PyObject* watch, PyObject* ev, PyObject* grad_fn, Held& h,
                   long long* seq, long long* count) {
  const Names& n = *g_names;
  if (!g_event.of(ev)) return 0;
  PyObject* transfer = g_event.get(ev, E_transfer);
  if (transfer == nullptr || !PyUnicode_Check(transfer) ||
      (transfer != n.none && PyUnicode_Compare(transfer, n.none) != 0))
    return 0;  // a transfer: settle_unreal may apply (api_tail)
  h.file = Py_XNewRef(g_event.get(ev, E_file));
  h.line = Py_XNewRef(g_event.get(ev, E_line));
  h.module = Py_XNewRef(g_event.get(ev, E_module));
  if (h.file == nullptr || h.line == nullptr || h.module == nullptr || h.file == Py_None)
    return 0;  // no call site: no tag
  h.tags_obj = PyObject_GetAttr(rec, n.node_tags);
  h.tags = h.tags_obj != nullptr ? PyObject_GetAttr(h.tags_obj, n.tags) : nullptr;
  long long limit = 0;
  if (h.tags == nullptr || !PyDict_CheckExact(h.tags) || !attr_int(h.tags_obj, n.limit, &limit) ||
      PyDict_GET_SIZE(h.tags) + 1 >= limit)
    return 0;  // NodeTags due for its prune
  h.attached = PyObject_GetAttr(watch, n.attached);
  long long prune = 0;
  if (h.attached == nullptr || !PyList_CheckExact(h.attached) ||
      PyList_GET_SIZE(h.attached) >= kMaxAttached || !attr_int(watch, n.attached_prune, &prune) ||
      PyList_GET_SIZE(h.attached) + 1 >= prune)
    return 0;  // the list full or due for its prune
  h.sites = PyObject_GetAttr(watch, n.sites);
  if (h.sites == nullptr || !PyDict_CheckExact(h.sites)) return 0;
  PyObject* key = PyTuple_Pack(2, h.file, h.line);
  if (key == nullptr) return 0;
  h.site = PyDict_GetItemWithError(h.sites, key);  // borrowed
  Py_DECREF(key);
  if (h.site == nullptr) return 0;  // a new site: _note_site makes it
  Py_INCREF(h.site);
  long long mark = 0, backward = 0, next_check = 0;
  if (!g_site.of(h.site) || !int_at(g_site.get(h.site, S_mark), &mark) ||
      !attr_int(watch, n.backward_seq, &backward) || mark != backward ||
      !int_at(g_site.get(h.site, S_count), count) ||
      !int_at(g_site.get(h.site, S_next_check), &next_check) || *count < 1 ||
      *count + 1 >= next_check)
    return 0;  // restarted by a backward, or due for its check
  if (g_site.get(h.site, S_flagged) != Py_False) return 0;  // a flagged site notes bytes
  if (!node_facts(grad_fn, seq, &h.leaf_version)) return 0;  // not a C++ node
  h.ref = py_grad_fn_ref(nullptr, grad_fn);
  if (h.ref == nullptr || h.ref == Py_None) return 0;
  return 1;
}

// A StorageRef on out's storage (torch's weak handle taken), or None where out has none.
PyObject* storage_ref_of(PyObject* out) {
  void* impl = storage_impl_of(out);
  if (impl == nullptr) Py_RETURN_NONE;
  PyObject* key = PyLong_FromVoidPtr(impl);
  if (key == nullptr) return nullptr;
  PyObject* ref = g_ref_type->tp_alloc(g_ref_type, 0);
  if (ref != nullptr && !g_ref.of(ref)) {
    Py_CLEAR(ref);
    PyErr_SetString(PyExc_TypeError, "attached: StorageRef without its slots");
  }
  PyObject* held = ref != nullptr ? py_storage_hold(nullptr, key) : nullptr;
  Py_DECREF(key);
  if (held == nullptr) {
    Py_XDECREF(ref);
    return nullptr;
  }
  g_ref.put(ref, R_cdata, held);
  g_ref.put(ref, R_free, Py_NewRef(g_ref_free));
  g_ref.put(ref, R_owners, Py_NewRef(g_ref_owners));
  return ref;
}

// Whether class `cls` has the named slots of `slots` (found now); TypeError where not.
template <int N>
bool has_slots(PyObject* cls, Slots<N>& slots) {
  auto* type = reinterpret_cast<PyTypeObject*>(cls);
  bool ok = type->tp_members != nullptr && type->tp_dictoffset == 0;
  for (int i = 0; ok && i < N; ++i) {
    ok = false;
    for (PyMemberDef* m = type->tp_members; m->name != nullptr; ++m)
      ok = ok || (m->type == T_OBJECT_EX && std::strcmp(m->name, slots.names[i]) == 0);
    if (!ok) PyErr_Format(PyExc_TypeError, "set_attached: %s has no slot %s", type->tp_name,
                          slots.names[i]);
  }
  if (type->tp_members == nullptr || type->tp_dictoffset != 0)
    PyErr_Format(PyExc_TypeError, "set_attached: %s has no __slots__", type->tp_name);
  return ok;
}

}  // namespace

int attached_finish(PyObject* rec, PyObject* watch, PyObject* ev, PyObject* out,
                    PyObject* grad_fn, PyObject* kind) {
  if (g_attached_type == nullptr || rec == nullptr || watch == nullptr || !PyUnicode_Check(kind))
    return 0;
  Held h;
  long long seq = 0, count = 0;
  if (attached_ready(rec, watch, ev, grad_fn, h, &seq, &count) != 1) {
    PyErr_Clear();
    return 0;
  }
  const Names& n = *g_names;
  // NodeTags.put(grad_fn, (module, "file:line", leaf version)) (_api_events._tag_grad_fn)
  PyObject* seq_o = PyLong_FromLongLong(seq);
  PyObject* where = seq_o != nullptr ? where_of(h.file, h.line) : nullptr;
  PyObject* tag = where != nullptr ? PyTuple_Pack(3, h.module, where, h.leaf_version) : nullptr;
  PyObject* value = tag != nullptr ? PyTuple_Pack(2, h.ref, tag) : nullptr;
  PyObject* tkey = value != nullptr ? PyTuple_Pack(2, seq_o, kind) : nullptr;
  bool ok = tkey != nullptr && PyDict_SetItem(h.tags, tkey, value) == 0;
  Py_XDECREF(where);
  Py_XDECREF(tag);
  Py_XDECREF(value);
  Py_XDECREF(tkey);
  // Watch.follow's attached entry (_Attached.of), listed, and _note_site's count
  PyObject* a = ok ? g_attached_type->tp_alloc(g_attached_type, 0) : nullptr;
  if (a != nullptr && !g_attached.of(a)) {
    Py_CLEAR(a);
    PyErr_SetString(PyExc_TypeError, "attached: _Attached without its slots");
  }
  PyObject* storage = a != nullptr ? storage_ref_of(out) : nullptr;
  PyObject* next = storage != nullptr ? PyLong_FromLongLong(count + 1) : nullptr;
  if (next != nullptr) {
    g_attached.put(a, A_node, Py_NewRef(h.ref));
    g_attached.put(a, A_ev, Py_NewRef(ev));
    g_attached.put(a, A_seq, Py_NewRef(seq_o));
    g_attached.put(a, A_kind, Py_NewRef(kind));
    g_attached.put(a, A_pending, Py_NewRef(Py_None));
    g_attached.put(a, A_storage, storage);
    ok = PyList_Append(h.attached, a) == 0;
    if (ok) {
      g_site.put(h.site, S_last, Py_NewRef(a));
      g_site.put(h.site, S_count, next);
    } else {
      Py_DECREF(next);
    }
  } else {
    Py_XDECREF(storage);
    ok = false;
  }
  Py_XDECREF(a);
  Py_XDECREF(seq_o);
  return ok ? 1 : -1;
}

// set_attached(attached_cls, storage_ref_cls, free_weak_ref, storage_owners): the classes the
// C path fills and the two callables a StorageRef holds; None clears (Python finishes every
// attached copy). TypeError where a class lacks one of its slots.
PyObject* py_set_attached(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "set_attached(attached_cls, storage_ref_cls, free_weak_ref, owners)"))
    return nullptr;
  if (g_names == nullptr) {
    g_names = new Names{interned("node_tags"),       interned("_tags"),  interned("_limit"),
                        interned("attached"),        interned("_attached_prune"),
                        interned("sites"),           interned("_backward_seq"),
                        interned("none")};
  }
  PyObject* old_attached = reinterpret_cast<PyObject*>(g_attached_type);
  // (the classes' slots are looked up by Slots<>::of on the first object made)
  g_attached_type = nullptr;  // off until the new set-up is complete
  Py_XDECREF(old_attached);
  if (argv[0] == Py_None) {
    set_slot(g_ref_free, Py_None);
    set_slot(g_ref_owners, Py_None);
    Py_RETURN_NONE;
  }
  if (!PyType_Check(argv[0]) || !PyType_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "set_attached: two classes expected");
    return nullptr;
  }
  if (!has_slots(argv[0], g_attached) || !has_slots(argv[1], g_ref)) return nullptr;
  set_slot(g_ref_free, argv[2]);
  set_slot(g_ref_owners, argv[3]);
  PyObject* old_ref = reinterpret_cast<PyObject*>(g_ref_type);
  g_ref_type = reinterpret_cast<PyTypeObject*>(Py_NewRef(argv[1]));
  Py_XDECREF(old_ref);
  g_attached_type = reinterpret_cast<PyTypeObject*>(Py_NewRef(argv[0]));
  Py_RETURN_NONE;
}

}  // namespace copytrace
