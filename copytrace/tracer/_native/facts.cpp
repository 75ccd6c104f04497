// Tensor facts for the recorder, in one call.
//
// facts(t, with_grad_fn) reads what copytrace/tracer/_facts.py's Python reader reads of a
// tensor (shape, dtype, device, autograd state, storage, view, version counter), from C++ and
// without re-entering torch's Python bindings, as one Facts (a struct sequence: a tuple whose
// items also have names, those of _facts.Facts). Only for plain tensors (torch.Tensor and
// nn.Parameter, strided, not nested, no symbolic sizes); for anything else it returns None and
// the Python readers decide. Never reads data, never syncs a device, keeps no reference.
// record.cpp reads the same items without building the tuple (read_facts).
//
// A storage is named by its StorageImpl's address (Facts.storage), never by a Python storage
// object: once torch has made one (THPStorage_Wrap, t.untyped_storage()) it preserves it with
// the StorageImpl for the storage's whole life, holding a strong reference
// (c10/util/intrusive_ptr.h, "PyObject preservation for Tensor and Storages"), so the
// storage's use_count() reads one more from then on. Autograd adds the gradients that reach
// one input in place only while that count is 1 (torch/csrc/autograd/input_buffer.cpp,
// can_accumulate_inplace): a Python storage object made by copytrace changes the program's
// version counters. storage_of, storage_hold and storage_owners below give the Python side
// what it needs of a storage (address, bytes, torch's weak handle, the strong count) without.
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <structmember.h>

#include <string>
#include <unordered_map>

#include "observer.h"

namespace copytrace {
namespace {

std::vector<PyObject*> g_dtype_names;                   // by ScalarType: "float32", ... (owned)
std::unordered_map<int32_t, PyObject*> g_device_names;  // by (type << 16 | index) (owned)

PyObject* dtype_name(at::ScalarType st) {
  const auto i = static_cast<size_t>(st);
  if (i >= g_dtype_names.size()) g_dtype_names.resize(i + 1, nullptr);
  PyObject*& slot = g_dtype_names[i];
  if (slot == nullptr) {
    // str(torch.float32) is "torch.float32": the name the Python reader keeps
    PyObject* text = PyObject_Str(reinterpret_cast<PyObject*>(torch::getTHPDtype(st)));
    if (text == nullptr) return nullptr;
    std::string s = PyUnicode_AsUTF8(text);
    Py_DECREF(text);
    if (s.rfind("torch.", 0) == 0) s = s.substr(6);
    slot = PyUnicode_InternFromString(s.c_str());
    if (slot == nullptr) return nullptr;
  }
  return Py_NewRef(slot);
}

PyObject* device_name(const c10::Device& d) {
  const int32_t key = (static_cast<int32_t>(d.type()) << 16) | (d.index() & 0xffff);
  auto found = g_device_names.find(key);
  if (found == g_device_names.end()) {
    PyObject* name = PyUnicode_InternFromString(d.str().c_str());  // as str(torch.device)
    if (name == nullptr) return nullptr;
    found = g_device_names.emplace(key, name).first;
  }
  return Py_NewRef(found->second);
}

// The last shape and the last stride tuple made, by length (up to 4 dimensions; owned): a tensor
// like the last one gets the same tuple object again (a tuple is immutable: shared, it reads
// the same), without allocating one tuple and its ints per event.
constexpr size_t kTupleCache = 5;
PyObject* g_last_shape[kTupleCache] = {};
PyObject* g_last_stride[kTupleCache] = {};

PyObject* int_tuple(c10::IntArrayRef values, PyObject** cache = nullptr) {
  const size_t n = values.size();
  if (cache != nullptr && n < kTupleCache && cache[n] != nullptr) {
    PyObject* last = cache[n];
    bool same = true;
    for (size_t i = 0; same && i < n; ++i) {
      PyObject* item = PyTuple_GET_ITEM(last, static_cast<Py_ssize_t>(i));
      same = PyLong_AsLongLong(item) == values[i];
    }
    if (same) return Py_NewRef(last);
  }
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
  }
  if (cache != nullptr && n < kTupleCache) {
    PyObject* old = cache[n];
    cache[n] = Py_NewRef(out);
    Py_XDECREF(old);
  }
  return out;
}

inline PyObject* new_bool(bool v) { return Py_NewRef(v ? Py_True : Py_False); }

// The Facts struct sequence: its field names are COPYTRACE_FACTS' (observer.h).
PyStructSequence_Field g_fact_fields[] = {
#define COPYTRACE_FACT_FIELD(name) {#name, nullptr},
    COPYTRACE_FACTS(COPYTRACE_FACT_FIELD)
#undef COPYTRACE_FACT_FIELD
    {nullptr, nullptr}};
PyStructSequence_Desc g_facts_desc = {
    "copytrace_observer.Facts",
    "A plain tensor's facts (copytrace/tracer/_facts.py's Facts, read in C++)", g_fact_fields,
    FACT_COUNT};
PyTypeObject* g_facts_type = nullptr;

}  // namespace

// is_leaf, grad_fn, its name and fake only with with_grad_fn (else None, None, None, False).
int read_facts(PyObject* obj, bool with_grad_fn, PyObject* items[FACT_COUNT], unsigned want) {
  for (int i = 0; i < FACT_COUNT; ++i) items[i] = nullptr;
  if (!THPVariable_CheckExact(obj)) return 0;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided || t.is_nested()) return 0;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->has_symbolic_sizes_strides() || !impl->has_storage()) return 0;
    const c10::Storage& storage = impl->storage();
    if (storage.unsafeGetStorageImpl() == nullptr) return 0;
    const c10::SymInt sym_bytes = storage.sym_nbytes();
    if (sym_bytes.is_heap_allocated()) return 0;
    const int64_t storage_bytes = sym_bytes.as_int_unchecked();
    const int64_t logical = t.numel() * static_cast<int64_t>(t.element_size());
    auto wanted = [want](Fact f) { return (want & (1u << f)) != 0; };
    items[FACT_shape] =
        wanted(FACT_shape) ? int_tuple(t.sizes(), g_last_shape) : Py_NewRef(Py_None);
    items[FACT_dtype] = dtype_name(t.scalar_type());
    items[FACT_device] = device_name(t.device());
    items[FACT_requires_grad] = new_bool(t.requires_grad());
    if (with_grad_fn) {
      // grad_fn() may regenerate a view's node: read only where the Python reader reads it
      const auto& grad_fn = t.grad_fn();
      items[FACT_is_leaf] = new_bool(!grad_fn);
      if (grad_fn) {
        items[FACT_grad_fn] = torch::autograd::functionToPyObject(grad_fn);
        if (items[FACT_grad_fn] != nullptr)
          items[FACT_grad_fn_name] = PyType_GetName(Py_TYPE(items[FACT_grad_fn]));
      } else {
        items[FACT_grad_fn] = Py_NewRef(Py_None);
        items[FACT_grad_fn_name] = Py_NewRef(Py_None);
      }
    } else {
      items[FACT_is_leaf] = Py_NewRef(Py_None);
      items[FACT_grad_fn] = Py_NewRef(Py_None);
      items[FACT_grad_fn_name] = Py_NewRef(Py_None);
    }
    items[FACT_storage] = PyLong_FromVoidPtr(storage.unsafeGetStorageImpl());  // its name
    items[FACT_storage_bytes] =
        wanted(FACT_storage_bytes) ? PyLong_FromLongLong(storage_bytes) : Py_NewRef(Py_None);
    items[FACT_logical_bytes] =
        wanted(FACT_logical_bytes) ? PyLong_FromLongLong(logical) : Py_NewRef(Py_None);
    items[FACT_offset] =
        wanted(FACT_offset) ? PyLong_FromLongLong(t.storage_offset()) : Py_NewRef(Py_None);
    items[FACT_stride] =
        wanted(FACT_stride) ? int_tuple(t.strides(), g_last_stride) : Py_NewRef(Py_None);
    items[FACT_version] =
        t.is_inference() ? Py_NewRef(Py_None) : PyLong_FromLongLong(t._version());
    items[FACT_fake] = new_bool(with_grad_fn && t.is_meta());
  } catch (const std::exception&) {
    for (int i = 0; i < FACT_COUNT; ++i) Py_CLEAR(items[i]);
    PyErr_Clear();
    return 0;  // let the Python readers decide
  }
  for (int i = 0; i < FACT_COUNT; ++i) {
    if (items[i] == nullptr) {
      for (int j = 0; j < FACT_COUNT; ++j) Py_CLEAR(items[j]);
      if (PyErr_Occurred()) PyErr_Clear();
      return 0;
    }
  }
  return 1;
}

// facts(t, with_grad_fn=False) -> Facts or None
PyObject* py_facts(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 2) {
    PyErr_SetString(PyExc_TypeError, "facts(t, with_grad_fn=False)");
    return nullptr;
  }
  const int with_grad_fn = nargs > 1 ? PyObject_IsTrue(argv[1]) : 0;
  if (with_grad_fn < 0) return nullptr;
  PyObject* items[FACT_COUNT];
  if (read_facts(argv[0], with_grad_fn == 1, items) != 1) Py_RETURN_NONE;
  PyObject* out = PyStructSequence_New(g_facts_type);
  if (out == nullptr) {
    for (PyObject* item : items) Py_DECREF(item);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < FACT_COUNT; ++i) PyStructSequence_SET_ITEM(out, i, items[i]);
  return out;
}

// copy_slots(proto): a new object of proto's type whose __slots__ hold proto's values (a
// shallow copy, about 10x cheaper than CopyEvent's 51-field __init__), not tracked by the
// cycle collector: an event holds only strings, numbers and tuples of them, so it can be in no
// reference cycle, and a trace keeps up to a million of them alive.
PyObject* copy_slots(PyObject*, PyObject* proto) {
  PyTypeObject* type = Py_TYPE(proto);
  if (!(type->tp_flags & Py_TPFLAGS_HEAPTYPE) || type->tp_members == nullptr ||
      type->tp_dictoffset != 0) {
    PyErr_SetString(PyExc_TypeError, "copy_slots: an instance of a class with __slots__");
    return nullptr;
  }
  PyObject* out = type->tp_alloc(type, 0);
  if (out == nullptr) return nullptr;
  for (PyMemberDef* member = type->tp_members; member->name != nullptr; ++member) {
    if (member->type != T_OBJECT_EX) continue;
    PyObject* value = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(proto) +
                                                    member->offset);
    Py_XINCREF(value);
    *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(out) + member->offset) = value;
  }
  if (PyObject_GC_IsTracked(out)) PyObject_GC_UnTrack(out);
  return out;
}

namespace {
// TensorImpl::matches_python_custom is protected: a derived class may name it, and a pointer to
// it (a member of TensorImpl) then applies to any TensorImpl.
struct PolicyPeek : c10::TensorImpl {
  static constexpr auto kMatches = &PolicyPeek::matches_python_custom;
};
}  // namespace

// sizes_strides_policy(t) -> int: 0 when torch answers t's sizes and strides itself, 1 when a
// tensor subclass answers its strides (and contiguity) in Python (_make_wrapper_subclass(...,
// dispatch_sizes_strides_policy="strides"): t.stride() reaches its __torch_dispatch__ as
// aten.sym_stride), 2 when it answers its sizes too ("sizes"). Reads the TensorImpl's flag,
// dispatches nothing. 0 for anything that is not a tensor.
PyObject* py_sizes_strides_policy(PyObject*, PyObject* obj) {
  if (!THPVariable_Check(obj)) return PyLong_FromLong(0);
  const c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  if (impl == nullptr || !impl->is_python_dispatch()) return PyLong_FromLong(0);
  using Policy = c10::TensorImpl::SizesStridesPolicy;
  long policy = (impl->*PolicyPeek::kMatches)(Policy::CustomSizes)     ? 2
                : (impl->*PolicyPeek::kMatches)(Policy::CustomStrides) ? 1
                                                                       : 0;
  return PyLong_FromLong(policy);
}

// sizes_default(t) -> (shape, numel, storage_offset) | None: what torch's TensorImpl itself
// holds (sizes_default(), numel_default(), storage_offset_default(); c10/core/TensorImpl.h),
// read without the sizes policy, so a tensor subclass that answers its sizes in Python
// (dispatch_sizes_strides_policy="sizes") is not asked (t.shape, t.numel() and
// t.storage_offset() would reach its __torch_dispatch__ as aten.sym_size, sym_numel,
// sym_storage_offset). None for anything that is not a tensor and for symbolic sizes.
PyObject* py_sizes_default(PyObject*, PyObject* obj) {
  if (!THPVariable_Check(obj)) Py_RETURN_NONE;
  const c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  if (impl == nullptr || impl->has_symbolic_sizes_strides()) Py_RETURN_NONE;
  PyObject* shape = int_tuple(impl->sizes_default());
  if (shape == nullptr) return nullptr;
  return Py_BuildValue("(NLL)", shape, static_cast<long long>(impl->numel_default()),
                       static_cast<long long>(impl->storage_offset_default()));
}

// storage_of(t) -> (address, nbytes) | None: the address of t's StorageImpl (any tensor,
// subclasses too, read without dispatch) and its bytes (None where symbolic); None where t has
// no storage torch lets one read (sparse, functorch's wrappers, a subclass whose storage
// access throws) or is no tensor. Makes no Python storage object.
PyObject* py_storage_of(PyObject*, PyObject* obj) {
  if (!THPVariable_Check(obj)) Py_RETURN_NONE;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined()) Py_RETURN_NONE;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (!impl->has_storage()) Py_RETURN_NONE;
    const c10::Storage& storage = impl->storage();  // throws where access is refused
    c10::StorageImpl* s = storage.unsafeGetStorageImpl();
    if (s == nullptr) Py_RETURN_NONE;
    const c10::SymInt& bytes = s->sym_nbytes();
    if (bytes.is_heap_allocated())
      return Py_BuildValue("(NO)", PyLong_FromVoidPtr(s), Py_None);
    return Py_BuildValue("(NL)", PyLong_FromVoidPtr(s),
                         static_cast<long long>(bytes.as_int_unchecked()));
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
}

void* storage_impl_of(PyObject* obj) {
  if (!THPVariable_Check(obj)) return nullptr;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage()) return nullptr;
    return t.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  } catch (const std::exception&) {
    return nullptr;
  }
}

// storage_hold(address) -> address: takes torch's weak handle on the live StorageImpl at
// `address` (an address storage_of or facts read from a tensor the caller still holds), as
// UntypedStorage._weak_ref() does; given back with UntypedStorage._free_weak_ref(address),
// read with _expired(address) and torch._C._storage_Use_Count(address). While it is held no
// other StorageImpl can be allocated at that address. Counted by nothing a program reads.
PyObject* py_storage_hold(PyObject*, PyObject* address) {
  void* ptr = PyLong_AsVoidPtr(address);
  if (ptr == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "storage_hold: a null address");
    return nullptr;
  }
  (void)c10::raw::intrusive_ptr::make_weak(static_cast<c10::StorageImpl*>(ptr));
  return Py_NewRef(address);
}

// storage_owners(address) -> int: the strong references to the StorageImpl at `address` (on
// which the caller holds a weak handle: storage_hold) other than torch's own Python storage
// object, which once made lives as long as the storage (see the top of this unit): the same
// count whether or not anyone ever called untyped_storage(). 0 once the storage is gone.
PyObject* py_storage_owners(PyObject*, PyObject* address) {
  void* ptr = PyLong_AsVoidPtr(address);
  if (ptr == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "storage_owners: a null address");
    return nullptr;
  }
  auto* s = static_cast<c10::StorageImpl*>(ptr);
  const uint32_t strong = c10::raw::weak_intrusive_ptr::use_count(s);
  const bool wrapped = strong > 0 && s->pyobj_slot()->load_pyobj() != nullptr;
  return PyLong_FromUnsignedLong(strong - (wrapped ? 1 : 0));
}

bool grad_fn_sequence_nr(PyObject* t, long long* seq) {
  if (!THPVariable_Check(t)) return true;
  try {
    const auto& node = THPVariable_Unpack(t).grad_fn();
    *seq = node ? static_cast<long long>(node->sequence_nr()) : -1;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool facts_init(PyObject* module) {
  if (g_facts_type == nullptr) {
    g_facts_type = PyStructSequence_NewType(&g_facts_desc);
    if (g_facts_type == nullptr) return false;
  }
  return PyModule_AddObjectRef(module, "Facts", reinterpret_cast<PyObject*>(g_facts_type)) == 0;
}

}  // namespace copytrace
