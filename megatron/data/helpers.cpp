// Index builders for Pile-scale datasets: one pass each, no temporary arrays the size of the data.
//
// Each function has a NumPy twin (megatron/data/sample_index.py, blending_index.py) that returns
// identical arrays; tests compare the two. Compiled on first use by compiled_helpers.py.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// (position in doc_idx, token offset) of the first token of every sample, plus the end row.
// Sample i starts at stream token i * seq_length; a position always lies inside a non-empty document.
template <typename DocIndex>
py::array_t<int64_t> build_sample_idx(py::array_t<int32_t, py::array::c_style> sizes,
                                      py::array_t<DocIndex, py::array::c_style> doc_idx, int64_t seq_length,
                                      int64_t num_epochs, int64_t tokens_per_epoch) {
    if (seq_length < 1 || num_epochs < 1 || tokens_per_epoch < 1) {
        throw std::invalid_argument("seq_length, num_epochs and tokens_per_epoch must be positive");
    }
    const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
    const int64_t num_sizes = sizes.shape(0);
    const int64_t num_docs = doc_idx.shape(0);
    const int32_t* size_of = sizes.data();
    const DocIndex* docs = doc_idx.data();

    py::array_t<int64_t> result({num_samples + 1, static_cast<int64_t>(2)});
    int64_t* out = result.mutable_data();
    std::string error;
    {
        py::gil_scoped_release release;
        int64_t position = 0;  // index into doc_idx
        int64_t offset = 0;    // tokens of that document already behind us
        for (int64_t row = 0; row <= num_samples && error.empty(); ++row) {
            int64_t remaining = row == 0 ? 0 : seq_length;
            while (true) {
                if (position >= num_docs) {
                    error = "doc_idx holds fewer tokens than num_epochs * tokens_per_epoch";
                    break;
                }
                const int64_t document = static_cast<int64_t>(docs[position]);
                if (document < 0 || document >= num_sizes) {
                    error = "doc_idx entry " + std::to_string(document) + " is outside sizes";
                    break;
                }
                const int64_t left = size_of[document] - offset;
                if (remaining < left) break;
                remaining -= left;
                ++position;
                offset = 0;
            }
            offset += remaining;
            out[2 * row] = position;
            out[2 * row + 1] = offset;
        }
    }
    if (!error.empty()) throw std::invalid_argument(error);
    return result;
}

// Blend datasets by virtual time: the k-th sample of dataset d is due at (k + 0.5) / weight[d];
// samples are taken in due order, ties to the lower dataset. Returns (dataset, sample within it).
py::tuple build_blending_indices(py::array_t<double, py::array::c_style> weights, int64_t num_samples) {
    const int64_t num_datasets = weights.shape(0);
    if (num_datasets < 1 || num_datasets > std::numeric_limits<uint16_t>::max() + 1) {
        throw std::invalid_argument("need between 1 and 65536 datasets to blend");
    }
    if (num_samples < 0) throw std::invalid_argument("num_samples must be non-negative");
    const double* weight = weights.data();
    for (int64_t d = 0; d < num_datasets; ++d) {
        if (!(weight[d] > 0.0)) throw std::invalid_argument("blending weights must be positive");
    }
    py::array_t<uint16_t> dataset_index(num_samples);
    py::array_t<int64_t> dataset_sample_index(num_samples);
    uint16_t* chosen = dataset_index.mutable_data();
    int64_t* within = dataset_sample_index.mutable_data();
    {
        py::gil_scoped_release release;
        // A min-heap of (due time, dataset): pairs compare by time, then by the lower dataset.
        using Due = std::pair<double, int64_t>;
        std::priority_queue<Due, std::vector<Due>, std::greater<Due>> next;
        std::vector<int64_t> taken(num_datasets, 0);
        for (int64_t d = 0; d < num_datasets; ++d) next.emplace(0.5 / weight[d], d);
        for (int64_t i = 0; i < num_samples; ++i) {
            const int64_t best = next.top().second;
            next.pop();
            chosen[i] = static_cast<uint16_t>(best);
            within[i] = taken[best]++;
            next.emplace((static_cast<double>(taken[best]) + 0.5) / weight[best], best);
        }
    }
    return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(helpers, module) {
    module.doc() = "Compiled index builders for GPT2Dataset and BlendableDataset";
    module.def("build_sample_idx", &build_sample_idx<int32_t>);
    module.def("build_sample_idx", &build_sample_idx<int64_t>);
    module.def("build_blending_indices", &build_blending_indices);
}
