//! Device tensors to and from the host buffers an MPI call reads and writes. On a backend whose
//! memory is host memory (flex) a uniquely owned tensor hands its buffer over without a copy;
//! elsewhere these are the staging copies of the call and live only as long as it does. Every
//! crossing runs on one process-wide clock ([`Staging`]), which each step's report takes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use ember_comm::Bf16;
use serde::{Deserialize, Serialize};

/// Time and bytes of the crossings between device and host memory since the last
/// [`Staging::take`], summed over every thread that stages (the training thread and the
/// communication threads). A crossing's time includes waiting for the kernels that produce
/// the tensor it reads, since reading a device tensor waits for them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Staging {
    /// Seconds of the crossings from the device to the host.
    pub to_host_seconds: f64,
    /// Seconds of the crossings from the host to the device.
    pub to_device_seconds: f64,
    /// Seconds of the crossings made on the thread that called [`Staging::take`] (the
    /// training thread, for a step's report): the part of its time they hold up directly.
    pub this_thread_seconds: f64,
    /// Bytes read back from the device.
    pub to_host_bytes: u64,
    /// Bytes written to the device.
    pub to_device_bytes: u64,
}

static TO_HOST_NANOS: AtomicU64 = AtomicU64::new(0);
static TO_DEVICE_NANOS: AtomicU64 = AtomicU64::new(0);
static TO_HOST: AtomicU64 = AtomicU64::new(0);
static TO_DEVICE: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Nanoseconds of this thread's crossings since its last [`Staging::take`].
    static THIS_THREAD_NANOS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

impl Staging {
    /// The crossings since the last call, process-wide; the counters restart at zero.
    pub fn take() -> Self {
        Self {
            to_host_seconds: TO_HOST_NANOS.swap(0, Ordering::Relaxed) as f64 * 1e-9,
            to_device_seconds: TO_DEVICE_NANOS.swap(0, Ordering::Relaxed) as f64 * 1e-9,
            this_thread_seconds: THIS_THREAD_NANOS.with(|n| n.replace(0)) as f64 * 1e-9,
            to_host_bytes: TO_HOST.swap(0, Ordering::Relaxed),
            to_device_bytes: TO_DEVICE.swap(0, Ordering::Relaxed),
        }
    }

    /// Seconds spent inside crossings either way (threads overlapping each other count
    /// twice).
    pub fn seconds(&self) -> f64 {
        self.to_host_seconds + self.to_device_seconds
    }

    /// Bytes per second from the device to the host (`None` where nothing crossed).
    pub fn to_host_rate(&self) -> Option<f64> {
        rate(self.to_host_bytes, self.to_host_seconds)
    }

    /// Bytes per second from the host to the device (`None` where nothing crossed).
    pub fn to_device_rate(&self) -> Option<f64> {
        rate(self.to_device_bytes, self.to_device_seconds)
    }
}

fn rate(bytes: u64, seconds: f64) -> Option<f64> {
    (bytes > 0 && seconds > 0.0).then(|| bytes as f64 / seconds)
}

/// Which way a crossing goes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Way {
    ToHost,
    ToDevice,
}

/// Runs `f`, a crossing of `bytes` bytes the way `way` says, on the staging clock.
pub(crate) fn timed<T>(way: Way, bytes: usize, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    record(way, bytes, start);
    out
}

/// Puts a crossing of `bytes` bytes that began at `start` and ends now on the staging clock.
pub(crate) fn record(way: Way, bytes: usize, start: Instant) {
    let nanos = start.elapsed().as_nanos() as u64;
    THIS_THREAD_NANOS.with(|n| n.set(n.get() + nanos));
    let (time, count) = match way {
        Way::ToHost => (&TO_HOST_NANOS, &TO_HOST),
        Way::ToDevice => (&TO_DEVICE_NANOS, &TO_DEVICE),
    };
    time.fetch_add(nanos, Ordering::Relaxed);
    count.fetch_add(bytes as u64, Ordering::Relaxed);
}

/// The values of an f32 tensor, on the host (cast from any other float dtype).
pub(crate) fn to_f32(t: Tensor<1>) -> Vec<f32> {
    let bytes = t.dims()[0] * 4;
    timed(Way::ToHost, bytes, || {
        crate::transport::host::cast(t, DType::F32)
            .into_data()
            .try_into_vec::<f32>()
            .expect("an f32 tensor reads back as f32")
    })
}

/// An f32 tensor of `values` on `device`.
pub(crate) fn from_f32(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    timed(Way::ToDevice, n * 4, || {
        Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32))
    })
}

/// The values of a bf16 tensor as bf16 bits, on the host.
pub(crate) fn to_bf16(t: Tensor<1>) -> Vec<Bf16> {
    let t = if t.dtype() == DType::BF16 {
        t
    } else {
        t.cast(DType::BF16)
    };
    let data = timed(Way::ToHost, t.dims()[0] * 2, || t.into_data());
    data.as_bytes()
        .chunks_exact(2)
        .map(|c| Bf16(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

/// A bf16 tensor of `values` on `device`.
pub(crate) fn from_bf16(values: &[Bf16], device: &Device) -> Tensor<1> {
    let bytes: Vec<u8> = values.iter().flat_map(|b| b.0.to_le_bytes()).collect();
    let n = bytes.len();
    let data = TensorData::from_bytes_vec(bytes, [values.len()], DType::BF16);
    timed(Way::ToDevice, n, || {
        Tensor::from_data(data, (device, DType::BF16))
    })
}

/// Bytes kept on the device as little-endian i32 words (the tail word zero-padded): how the
/// int8 secondary copy is held.
pub(crate) fn bytes_to_device(bytes: &[u8], device: &Device) -> Tensor<1, Int> {
    let words: Vec<i32> = bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            i32::from_le_bytes(w)
        })
        .collect();
    let n = words.len();
    timed(Way::ToDevice, n * 4, || {
        Tensor::from_data(TensorData::new(words, [n]), (device, DType::I32))
    })
}

/// The first `len` bytes of words written by [`bytes_to_device`].
pub(crate) fn bytes_from_device(t: Tensor<1, Int>, len: usize) -> Vec<u8> {
    let data = timed(Way::ToHost, t.dims()[0] * 4, || t.into_data());
    let mut bytes = data.as_bytes().to_vec();
    bytes.truncate(len);
    bytes
}

/// Bytes a tensor of `numel` elements of `dtype` takes.
pub(crate) fn tensor_bytes(t: &Tensor<1>) -> u64 {
    (t.dims()[0] * t.dtype().size()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_keep_every_bit() {
        let device = Device::flex();
        let v = vec![1.5f32, -0.0, f32::MIN_POSITIVE, 3.0e38];
        assert_eq!(to_f32(from_f32(v.clone(), &device)), v);
        let b: Vec<Bf16> = v.iter().map(|&x| Bf16::from_f32(x)).collect();
        let t = from_bf16(&b, &device);
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(to_bf16(t), b);
        let bytes: Vec<u8> = (0..11).collect();
        assert_eq!(
            bytes_from_device(bytes_to_device(&bytes, &device), 11),
            bytes
        );
    }
}
