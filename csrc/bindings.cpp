// engine._C: the host-side hot path (block manager, batch builder, KV checksum sums) for the Python engine.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "block_manager.h"
#include "fold_sums.h"

namespace py = pybind11;
using polyserve::BatchMetadata;
using polyserve::BlockManager;

namespace {

using IndexArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// A numpy view of `data`; `owner` (the BatchMetadata) stays alive as long as the view does. Writable, so that
// torch.from_numpy shares it without a warning: every build_batch returns fresh arrays, nothing else holds them.
template <typename T>
py::array view(const polyserve::OutputArray<T>& data, std::vector<py::ssize_t> shape, py::handle owner) {
    return py::array(py::dtype::of<T>(), std::move(shape), {}, data.data(), owner);
}

template <typename T, polyserve::OutputArray<T> BatchMetadata::*member>
py::array flat_view(py::object self) {
    const auto& data = self.cast<const BatchMetadata&>().*member;
    return view(data, {static_cast<py::ssize_t>(data.size())}, self);
}

const int64_t* checked_1d(const IndexArray& array, const char* name, py::ssize_t expected) {
    if (array.ndim() != 1) throw py::value_error(std::string("build_batch: ") + name + " must be 1-D");
    if (array.shape(0) != expected)
        throw py::value_error(std::string("build_batch: ") + name + " has length " + std::to_string(array.shape(0)) +
                              ", seq_ids has " + std::to_string(expected));
    return array.data();
}

// The one-dimensional, contiguous bytes of a buffer; ValueError naming `what` when they are not.
py::buffer_info contiguous_bytes(const py::buffer& buffer, bool writable, const char* what) {
    py::buffer_info info = buffer.request(writable);
    py::ssize_t expected = info.itemsize;
    for (py::ssize_t axis = info.ndim - 1; axis >= 0; --axis) {
        if (info.shape[axis] > 1 && info.strides[axis] != expected)
            throw py::value_error(std::string("add_fold_sums: ") + what + " is not contiguous");
        expected *= info.shape[axis];
    }
    return info;
}

void add_fold_sums(const py::buffer& data, const py::buffer& sums) {
    const py::buffer_info words = contiguous_bytes(data, false, "data");
    const py::buffer_info columns = contiguous_bytes(sums, true, "sums");
    if (columns.itemsize != sizeof(uint64_t) || columns.ndim != 1 || columns.size == 0)
        throw py::value_error("add_fold_sums: sums must be a non-empty 1-D array of 64-bit words");
    const auto nbytes = static_cast<size_t>(words.size * words.itemsize);
    const auto row_bytes = static_cast<size_t>(columns.size) * sizeof(uint64_t);
    if (nbytes % row_bytes)
        throw py::value_error("add_fold_sums: " + std::to_string(nbytes) + " bytes are no whole number of " +
                              std::to_string(row_bytes) + "-byte folds");
    py::gil_scoped_release unlocked;  // the buffers stay exported until `words` and `columns` go
    polyserve::add_fold_sums(static_cast<const unsigned char*>(words.ptr), nbytes / row_bytes,
                             static_cast<size_t>(columns.size), static_cast<uint64_t*>(columns.ptr));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "PolyServe host hot path: paged-KV block manager with prefix caching, per-step batch metadata, the "
              "column sums of a KV chunk's checksum";

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const polyserve::UnknownSequence& e) {
            PyErr_SetString(PyExc_KeyError, e.what());
        }
    });

    py::class_<BatchMetadata>(m, "BatchMetadata")
        .def_property_readonly("input_ids", &flat_view<int64_t, &BatchMetadata::input_ids>)
        .def_property_readonly("positions", &flat_view<int64_t, &BatchMetadata::positions>)
        .def_property_readonly("slot_mapping", &flat_view<int64_t, &BatchMetadata::slot_mapping>)
        .def_property_readonly("block_tables",
                               [](py::object self) {
                                   const auto& meta = self.cast<const BatchMetadata&>();
                                   return view(meta.block_tables, {meta.num_seqs, meta.max_blocks}, self);
                               })
        .def_property_readonly("seq_lens", &flat_view<int32_t, &BatchMetadata::seq_lens>)
        .def_property_readonly("query_start_loc", &flat_view<int32_t, &BatchMetadata::query_start_loc>)
        .def_property_readonly("logits_indices", &flat_view<int64_t, &BatchMetadata::logits_indices>)
        .def_property_readonly("sample_rows", &flat_view<int64_t, &BatchMetadata::sample_rows>);

    py::class_<BlockManager>(m, "BlockManager")
        .def(py::init<int64_t, int64_t, bool>(), py::arg("num_blocks"), py::arg("block_size"),
             py::arg("enable_prefix_caching"))
        .def_property_readonly("block_size", &BlockManager::block_size)
        .def_property_readonly("num_total_blocks", &BlockManager::num_total_blocks)
        .def("num_free_blocks", &BlockManager::num_free_blocks,
             "Blocks with ref count 0, evictable prefix-cache blocks included.")
        .def("num_cached_blocks", &BlockManager::num_cached_blocks, "Blocks currently registered in the prefix cache.")
        .def("add_sequence", &BlockManager::add_sequence, py::arg("seq_id"), py::arg("token_ids"))
        .def("append_token", &BlockManager::append_token, py::arg("seq_id"), py::arg("token_id"))
        .def("num_tokens", &BlockManager::num_tokens, py::arg("seq_id"))
        .def("allocate_cached_prefix", &BlockManager::allocate_cached_prefix, py::arg("seq_id"),
             "Take the longest cached run of the sequence's full blocks; returns the cached token count.")
        .def("ensure_capacity", &BlockManager::ensure_capacity, py::arg("seq_id"), py::arg("num_tokens"),
             "Hold blocks for the first num_tokens tokens, all or nothing; False when the pool is short.")
        .def("mark_computed", &BlockManager::mark_computed, py::arg("seq_id"), py::arg("num_computed_tokens"))
        .def("free_blocks", &BlockManager::free_blocks, py::arg("seq_id"))
        .def("remove_sequence", &BlockManager::remove_sequence, py::arg("seq_id"))
        .def("num_blocks_of", &BlockManager::num_blocks_of, py::arg("seq_id"))
        .def("block_table", &BlockManager::block_table, py::arg("seq_id"))
        .def("ref_count", &BlockManager::ref_count, py::arg("block_id"))
        .def(
            "build_batch",
            [](BlockManager& self, const IndexArray& seq_ids, const IndexArray& num_computed, const IndexArray& num_new) {
                if (seq_ids.ndim() != 1) throw py::value_error("build_batch: seq_ids must be 1-D");
                const py::ssize_t batch_size = seq_ids.shape(0);
                const int64_t* computed = checked_1d(num_computed, "num_computed", batch_size);
                const int64_t* fresh = checked_1d(num_new, "num_new", batch_size);
                return self.build_batch(seq_ids.data(), computed, fresh, batch_size);
            },
            py::arg("seq_ids"), py::arg("num_computed"), py::arg("num_new"))
        .def("check_invariants", &BlockManager::check_invariants);

    m.def("add_fold_sums", &add_fold_sums, py::arg("data"), py::arg("sums"),
          "Adds the 64-bit little-endian words of `data` (contiguous bytes, a whole number of rows of len(sums) "
          "words) into `sums` (a writable, contiguous uint64 array) column by column, modulo 2**64, without the "
          "GIL.");
}
