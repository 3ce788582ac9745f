"""NVML source: GPU memory (v2, which separates driver-reserved memory), utilisation and NVLink
errors.

Utilisation comes from ``nvmlDeviceGetSamples``: the driver's own sample buffer since the last
read, averaged, rather than one instantaneous reading that can miss short bursts. NVLink errors
are the driver's cumulative counters (replay, recovery, CRC of flits and of data) summed over the
GPU's active links: a rise over a window is link loss (seed 000's "NVLink loss 0"); a GPU with no
NVLink reports None. Without a GPU or driver the source opens as unavailable with NVML's reason,
and the run goes on without it.
"""

from __future__ import annotations

from typing import Any

from harness.telemetry.sampler import Availability

# The NVLink error counters summed (nvmlNvLinkErrorCounter_t), by their pynvml names.
NVLINK_COUNTERS = (
    "NVML_NVLINK_ERROR_DL_REPLAY",
    "NVML_NVLINK_ERROR_DL_RECOVERY",
    "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "NVML_NVLINK_ERROR_DL_CRC_DATA",
)
# nvmlValueType_t -> the c_nvmlValue_t union member holding that type
_VALUE_FIELDS = dict(enumerate(("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")))


class NvmlSource:
    """One row per GPU: memory used/reserved/total in bytes and utilisation in percent."""

    kind = "nvml"

    def __init__(self, indices: list[int] | None = None) -> None:
        self.indices = indices
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] = []
        self._last_ts: dict[int, int] = {}
        self._names: dict[int, str] = {}

    def open(self) -> Availability:
        try:
            import pynvml
        except ImportError as exc:
            return Availability(False, f"nvidia-ml-py not installed: {exc}")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return Availability(False, f"NVML unavailable: {exc}")
        self._nvml = pynvml
        count = pynvml.nvmlDeviceGetCount()
        wanted = range(count) if self.indices is None else self.indices
        for i in wanted:
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            self._handles.append((i, handle))
            name = pynvml.nvmlDeviceGetName(handle)
            self._names[i] = name.decode() if isinstance(name, bytes) else str(name)
            self._last_ts[i] = 0
        if not self._handles:
            self.close()
            return Availability(False, "NVML found no GPU")
        return Availability(True)

    def _utilisation(self, index: int, handle: Any) -> float | None:
        """Mean GPU utilisation (%) over the driver samples newer than the last read."""
        nvml = self._nvml
        try:
            value_type, samples = nvml.nvmlDeviceGetSamples(
                handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, self._last_ts[index]
            )
        except nvml.NVMLError_NotFound:
            return None
        fresh = [s for s in samples if s.timeStamp > self._last_ts[index]]
        if not fresh:
            return None
        self._last_ts[index] = max(s.timeStamp for s in fresh)
        attr = _VALUE_FIELDS.get(value_type, "uiVal")
        return sum(float(getattr(s.sampleValue, attr)) for s in fresh) / len(fresh)

    def _nvlink_errors(self, handle: Any) -> int | None:
        """The NVLink error counters summed over the GPU's active links; None without NVLink."""
        nvml = self._nvml
        total, links = 0, 0
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                total += sum(
                    int(nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, getattr(nvml, name)))
                    for name in NVLINK_COUNTERS
                )
            except nvml.NVMLError:
                continue
            links += 1
        return total if links else None

    def read(self) -> list[dict[str, Any]]:
        nvml = self._nvml
        rows = []
        for index, handle in self._handles:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            rows.append(
                {
                    "name": f"gpu{index}",
                    "gpu_util_pct": self._utilisation(index, handle),
                    "mem_used_bytes": int(mem.used),
                    "mem_reserved_bytes": int(mem.reserved),
                    "mem_total_bytes": int(mem.total),
                    "mem_free_bytes": int(mem.free),
                    "nvlink_errors": self._nvlink_errors(handle),
                }
            )
        return rows

    def describe(self) -> dict[str, Any]:
        return {"gpus": [{"index": i, "name": self._names[i]} for i, _ in self._handles]}

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
        self._handles = []
