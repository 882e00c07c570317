// qgru CUDA backend: the Python binding (pybind11) of the layer and plan code in qgru_cuda.cpp,
// through its interface qgru_cuda_backend.h.
#include <torch/extension.h>

#include <map>
#include <string>
#include <vector>

#include "qgru_cuda_backend.h"
#include "qgru_cuda_launch.h"

#ifndef QGRU_TORCH_VERSION
#error "QGRU_TORCH_VERSION must be defined by the build (qgru/native/build.py)"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qgru CUDA backend (bit-exact with qgru/golden.py)";
  m.attr("built_for_torch") = QGRU_TORCH_VERSION;
  m.attr("max_window_rows") = qgru::cuda::kMaxWindowRows;  // input rows of one W.x window, at most
  m.def("quantize", &qgru::cuda_api::quantize, "float CUDA tensor -> int32 on (scale, zp, bits); NaN: see nan_flags",
        pybind11::arg("x"), pybind11::arg("scale"), pybind11::arg("zp"), pybind11::arg("bits"), pybind11::arg("what"));
  m.def("quantize_levels", &qgru::cuda_api::quantize_levels,
        "golden.quantize_levels: (q int32, level int32 per token); NaN: see nan_flags", pybind11::arg("x"),
        pybind11::arg("scale"), pybind11::arg("lo"), pybind11::arg("hi"), pybind11::arg("zp"), pybind11::arg("bits"),
        pybind11::arg("what"));
  m.def("dequantize", &qgru::cuda_api::dequantize, "integer CUDA tensor -> float32 (q - zp) * scale", pybind11::arg("q"),
        pybind11::arg("scale"), pybind11::arg("zp"));
  m.def("nan_flags", &qgru::cuda_api::nan_flags, pybind11::arg("device"), pybind11::arg("clear"),
        "the device's NaN flag (1: an input, 2: an h0 held NaN) after the current stream's work; waits for it");
  m.def("check_cublas", &qgru::cuda_api::check_cublas_version,
        "raise unless the loaded cuBLAS has the major version of the headers the extension was built with");
  pybind11::class_<qgru::cuda_api::Stack>(m, "Stack")
      .def(pybind11::init<const std::vector<std::shared_ptr<qgru::cuda_api::Layer>>&, std::vector<std::vector<double>>,
                          const std::vector<std::vector<double>>&>(),
           pybind11::arg("layers"), pybind11::arg("values"), pybind11::arg("levels") = std::vector<std::vector<double>>())
      .def("forward", &qgru::cuda_api::Stack::forward, pybind11::arg("x"), pybind11::arg("h0"),
           pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<qgru::cuda_api::Layer, std::shared_ptr<qgru::cuda_api::Layer>>(m, "Layer")
      .def(pybind11::init<qgru::TensorMap, qgru::IntMap>())
      .def("forward", &qgru::cuda_api::Layer::forward, pybind11::arg("qx"), pybind11::arg("qh0"),
           pybind11::arg("lengths") = pybind11::none(), pybind11::arg("level") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("x_levels", &qgru::cuda_api::Layer::x_levels)
      // the GEMM path, as the CPU Layer reports its own (NativeLayer.gemm; the tests check it)
      .def_property_readonly("gemm", [](const qgru::cuda_api::Layer&) { return std::string("cublas"); })
      .def_property_readonly("counters", &qgru::cuda_api::Layer::counters)
      .def("window_steps", &qgru::cuda_api::Layer::window_steps, pybind11::arg("T"), pybind11::arg("N"),
           "steps per W.x window of a call of this shape (the tests span two windows)")
      .def("persistent_plan", &qgru::cuda_api::Layer::persistent_plan, pybind11::arg("N"),
           "the persistent recurrence's plan for N batch rows (blocks, units, rows_tile, ...); {} where the "
           "per-step path runs (QGRU_CUDA_PERSISTENT unset or 0, or the shape does not fit on chip)");
}
