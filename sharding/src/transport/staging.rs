//! Device tensors to and from the host buffers an MPI call reads and writes. On a backend whose
//! memory is host memory (flex) a uniquely owned tensor hands its buffer over without a copy;
//! elsewhere these are the staging copies of the call and live only as long as it does. Every
//! crossing runs on one process-wide clock ([`Staging`]), which each step's report takes; on
//! flex, where nothing crosses, the clock stays at zero.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use burn::tensor::{DType, Device, Tensor, TensorData, bf16};
use ember_comm::Bf16;
use serde::{Deserialize, Serialize};

use crate::error::ShardError;

/// Time and bytes of the crossings between device and host memory since the last
/// [`Staging::take`], summed over every thread that stages (the training thread and the
/// communication threads). A read first waits for the kernels that produce its tensor, on a
/// clock of its own (`to_host_wait_seconds`), so a crossing's seconds are the copy's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Staging {
    /// Seconds of the crossings from the device to the host.
    pub to_host_seconds: f64,
    /// Seconds the reads waited for the kernels that produce their tensors, before copying.
    #[serde(default)]
    pub to_host_wait_seconds: f64,
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
static TO_HOST_WAIT_NANOS: AtomicU64 = AtomicU64::new(0);
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
            to_host_wait_seconds: TO_HOST_WAIT_NANOS.swap(0, Ordering::Relaxed) as f64 * 1e-9,
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

/// Runs `f`, a crossing of `bytes` bytes the way `way` says between host memory and
/// `device`'s, on the staging clock. On a device whose memory is host memory (flex) nothing
/// crosses, and nothing is recorded.
pub(crate) fn timed<T>(way: Way, device: &Device, bytes: usize, f: impl FnOnce() -> T) -> T {
    if !has_own_memory(device) {
        return f();
    }
    let start = Instant::now();
    let out = f();
    record(way, bytes, start);
    out
}

/// Waits for the kernels that produce `t` (by reading its first four bytes or fewer), on the
/// clock of reads' waits, so that the crossing that follows is timed alone. Nothing to wait
/// for on flex. A kernel or an allocation that failed on the device is the error.
pub(crate) fn await_kernels(t: &Tensor<1>) -> Result<(), ShardError> {
    let n = t.dims()[0];
    if !has_own_memory(&t.device()) || n == 0 {
        return Ok(());
    }
    let start = Instant::now();
    // A whole 4-byte word where there is one: some devices copy in words.
    let elems = (4 / t.dtype().size()).clamp(1, n);
    crate::transport::host::read(t.clone().slice(0..elems))?;
    TO_HOST_WAIT_NANOS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    Ok(())
}

/// Whether `device` keeps tensors in memory of its own, which data crosses to reach MPI.
pub(crate) fn has_own_memory(device: &Device) -> bool {
    *device != Device::flex()
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

/// The elements a crossing carries: f32, and bf16 as its bits ([`Bf16`]), each viewed in the
/// host data of its dtype.
pub(crate) trait Crossing: Copy {
    /// The dtype of the data the values live in.
    const DTYPE: DType;

    /// The values of `data`, which is of [`Self::DTYPE`].
    fn view(data: &TensorData) -> &[Self];

    /// The values of `data`, which is of [`Self::DTYPE`], to fill.
    fn view_mut(data: &mut TensorData) -> &mut [Self];

    /// Host data of `len` zeros.
    fn zeros(len: usize) -> TensorData;
}

impl Crossing for f32 {
    const DTYPE: DType = DType::F32;

    fn view(data: &TensorData) -> &[f32] {
        data.as_slice::<f32>().expect("host data of f32")
    }

    fn view_mut(data: &mut TensorData) -> &mut [f32] {
        data.as_mut_slice::<f32>().expect("host data of f32")
    }

    fn zeros(len: usize) -> TensorData {
        TensorData::new(vec![0f32; len], [len])
    }
}

impl Crossing for Bf16 {
    const DTYPE: DType = DType::BF16;

    fn view(data: &TensorData) -> &[Bf16] {
        let values = data.as_slice::<bf16>().expect("host data of bf16");
        // SAFETY: `Bf16` and `bf16` are both `repr(transparent)` over `u16`: the same size and
        // alignment, every bit pattern valid in both.
        unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<Bf16>(), values.len()) }
    }

    fn view_mut(data: &mut TensorData) -> &mut [Bf16] {
        let values = data.as_mut_slice::<bf16>().expect("host data of bf16");
        // SAFETY: as in `view`.
        unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<Bf16>(), values.len()) }
    }

    fn zeros(len: usize) -> TensorData {
        TensorData::new(vec![bf16::ZERO; len], [len])
    }
}

/// `t` cast to `E`'s dtype and read back, after the wait for its kernels on their clock, and
/// made by `keep` into what the caller keeps, on the crossing's clock: a copy out of the
/// runtime's buffer is part of the crossing.
fn read_with<E: Crossing, R>(
    t: Tensor<1>,
    keep: impl FnOnce(TensorData) -> Result<R, ShardError>,
) -> Result<R, ShardError> {
    let t = crate::transport::host::cast(t, E::DTYPE);
    await_kernels(&t)?;
    let (device, bytes) = (t.device(), t.dims()[0] * E::DTYPE.size());
    timed(Way::ToHost, &device, bytes, || {
        let data = crate::transport::host::read(t)?;
        if data.dtype() != E::DTYPE {
            return Err(ShardError::Device(format!(
                "a {:?} tensor read back as {:?}",
                E::DTYPE,
                data.dtype()
            )));
        }
        keep(data)
    })
}

/// The values of an f32 tensor, on the host (cast from any other float dtype), as a vector of
/// their own: where the runtime read them into a buffer of its own (pinned memory, on CUDA),
/// copied out of it. [`read_f32`] lends them where they landed.
pub(crate) fn to_f32(t: Tensor<1>) -> Result<Vec<f32>, ShardError> {
    read_with::<f32, _>(t, |data| {
        data.try_into_vec::<f32>()
            .map_err(|e| ShardError::device(&e))
    })
}

/// The values of a tensor as bf16 bits on the host (cast from any other float dtype), as a
/// vector of their own, copied out of the runtime's buffer.
pub(crate) fn to_bf16(t: Tensor<1>) -> Result<Vec<Bf16>, ShardError> {
    read_with::<Bf16, _>(t, |data| {
        data.try_into_vec::<bf16>()
            .map(bf16_of_burn)
            .map_err(|e| ShardError::device(&e))
    })
}

/// Host values read back from a device tensor, left where the read put them (on CUDA, the
/// runtime's pinned buffer, handed back to its pool when this is dropped; on flex, the
/// tensor's own buffer): an MPI call that only reads them takes them without a copy into a
/// vector. The runtime's read keeps the tensor's device buffer alive as long as its values:
/// hold one for the call that sends them, not across a step ([`to_f32`] and [`to_bf16`] give
/// values of their own).
pub(crate) struct HostRead<E> {
    data: TensorData,
    element: std::marker::PhantomData<E>,
}

impl<E: Crossing> std::ops::Deref for HostRead<E> {
    type Target = [E];

    fn deref(&self) -> &[E] {
        E::view(&self.data)
    }
}

/// The values of a tensor as `E` (cast from any other float dtype) on the host, where the
/// read put them: [`to_f32`] and [`to_bf16`] without the copy into a vector of their own.
fn read_in_place<E: Crossing>(t: Tensor<1>) -> Result<HostRead<E>, ShardError> {
    read_with::<E, _>(t, |data| {
        Ok(HostRead {
            data,
            element: std::marker::PhantomData,
        })
    })
}

/// [`read_in_place`] as f32.
pub(crate) fn read_f32(t: Tensor<1>) -> Result<HostRead<f32>, ShardError> {
    read_in_place(t)
}

/// [`read_in_place`] as bf16 bits.
pub(crate) fn read_bf16(t: Tensor<1>) -> Result<HostRead<Bf16>, ShardError> {
    read_in_place(t)
}

/// An f32 tensor of `values` on `device`.
pub(crate) fn from_f32(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    timed(Way::ToDevice, device, n * 4, || {
        Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32))
    })
}

/// A bf16 tensor of `values` on `device`.
pub(crate) fn from_bf16(values: &[Bf16], device: &Device) -> Tensor<1> {
    let n = values.len();
    let data = TensorData::new(burn_bf16_of(values), [n]);
    timed(Way::ToDevice, device, n * 2, || {
        Tensor::from_data(data, (device, DType::BF16))
    })
}

/// Host memory for values on their way to a device, for an MPI call to fill before they go
/// up. On a runtime that stages host data in memory of its own (CUDA: page-locked memory from
/// the pool of the calling thread's stream, reused from step to step), that memory: the write
/// then copies from it directly, with no host copy between MPI's buffer and the device's. On
/// other devices (wgpu, flex) a vector, which a write takes as it would any.
pub(crate) struct Staged {
    data: TensorData,
    device: Device,
}

impl Staged {
    /// `len` elements of `E` for `device`, their values unspecified until filled.
    pub(crate) fn new<E: Crossing>(len: usize, device: &Device) -> Self {
        let device = device.clone();
        #[cfg(feature = "cubecl")]
        if has_own_memory(&device) && len > 0 && !cube_staging::stages_nothing(&device) {
            let dtype = E::DTYPE;
            let bytes = len * dtype.size();
            // SAFETY: the placeholder is never read: the runtime's staging replaces it with a
            // buffer of its own (copying nothing from it), or it is dropped below.
            let placeholder = unsafe {
                burn::tensor::Bytes::from_controller(Box::new(cube_staging::Unfilled(bytes)), bytes)
            };
            let mut data = TensorData::from_bytes(placeholder, [len], dtype);
            device.staging(std::iter::once(&mut data));
            if data.bytes().property() != burn::tensor::AllocationProperty::Other {
                return Self { data, device };
            }
            // Asking costs a round trip to the device's server: asked once per device.
            cube_staging::remember_stages_nothing(&device);
        }
        Self {
            data: E::zeros(len),
            device,
        }
    }

    /// Whether the buffer is the runtime's page-locked memory.
    pub(crate) fn is_pinned(&self) -> bool {
        self.data.bytes().property() == burn::tensor::AllocationProperty::Pinned
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The values, of `E`'s dtype, the one the buffer was made for.
    pub(crate) fn values<E: Crossing>(&self) -> &[E] {
        E::view(&self.data)
    }

    /// The values, of `E`'s dtype, the one the buffer was made for, to fill.
    pub(crate) fn values_mut<E: Crossing>(&mut self) -> &mut [E] {
        E::view_mut(&mut self.data)
    }

    /// The values as a tensor on the device, on the crossing's clock.
    pub(crate) fn upload(self) -> Tensor<1> {
        let Self { data, device } = self;
        let (dtype, bytes) = (data.dtype(), data.bytes().len());
        timed(Way::ToDevice, &device, bytes, || {
            Tensor::from_data(data, (&device, dtype))
        })
    }
}

#[cfg(feature = "cubecl")]
mod cube_staging {
    use std::mem::MaybeUninit;

    use burn::tensor::Device;
    use cubecl::bytes::{AccessError, AccessPolicy, AllocationController, AllocationProperty};

    /// Devices whose runtime stages no host memory of its own (wgpu's).
    static STAGES_NOTHING: std::sync::Mutex<Vec<Device>> = std::sync::Mutex::new(Vec::new());

    pub(super) fn stages_nothing(device: &Device) -> bool {
        STAGES_NOTHING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(device)
    }

    pub(super) fn remember_stages_nothing(device: &Device) {
        let mut all = STAGES_NOTHING.lock().unwrap_or_else(|e| e.into_inner());
        if !all.contains(device) {
            all.push(device.clone());
        }
    }

    /// The stand-in for a buffer of this many bytes that a runtime's staging replaces with its
    /// own: it holds no memory, and copies nothing into the replacement (MPI fills it after).
    pub(super) struct Unfilled(pub(super) usize);

    impl AllocationController for Unfilled {
        fn alloc_align(&self) -> usize {
            1
        }

        fn property(&self) -> AllocationProperty {
            AllocationProperty::Other
        }

        unsafe fn memory_mut(
            &mut self,
            _policy: AccessPolicy,
        ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
            Err(AccessError::Read(
                "a staging placeholder holds no memory".into(),
            ))
        }

        fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
            Err(AccessError::Read(
                "a staging placeholder holds no memory".into(),
            ))
        }

        fn capacity(&self) -> usize {
            self.0
        }

        unsafe fn copy_into(&self, _buf: &mut [u8]) {}
    }
}

/// `values` as Burn's bf16 elements, in one copy (`Bf16` and `bf16` are both the bits as a
/// `u16`). A loop building bytes moved about 1 GB/s, and bytes handed to a tensor were copied
/// once more.
fn burn_bf16_of(values: &[Bf16]) -> Vec<bf16> {
    values.iter().map(|b| bf16::from_bits(b.0)).collect()
}

/// `values` as `Bf16`, taking the vector over without a copy.
fn bf16_of_burn(values: Vec<bf16>) -> Vec<Bf16> {
    let mut values = std::mem::ManuallyDrop::new(values);
    let (ptr, len, cap) = (values.as_mut_ptr(), values.len(), values.capacity());
    // SAFETY: `Bf16` and `bf16` are both `repr(transparent)` over `u16`: the same size and
    // alignment, every bit pattern valid in both; the vector's allocation is handed over whole
    // (the original is never dropped).
    unsafe { Vec::from_raw_parts(ptr.cast::<Bf16>(), len, cap) }
}

/// Bytes a tensor of `numel` elements of `dtype` takes.
pub(crate) fn tensor_bytes(t: &Tensor<1>) -> u64 {
    (t.dims()[0] * t.dtype().size()) as u64
}

/// The rate of each kind of crossing an MPI call makes, measured through the functions the
/// engine stages with: f32 and bf16 tensors of `bytes` bytes each way. Reads are those of
/// the reductions and all-reduces: the values left where the runtime's read put them
/// (`read_f32`, `read_bf16`); writes those of the gathers and of the reductions' last hops:
/// values in memory staged for the device (`Staged`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CrossingRates {
    /// Bytes per crossing.
    pub bytes: u64,
    /// Bytes per second of an f32 tensor read back to the host.
    pub to_host_f32: f64,
    /// Bytes per second of host f32 values written to a device tensor.
    pub to_device_f32: f64,
    /// Bytes per second of a bf16 tensor read back to the host as bf16 bits.
    pub to_host_bf16: f64,
    /// Bytes per second of host bf16 bits written to a device tensor.
    pub to_device_bf16: f64,
    /// Whether the runtime staged the writes' values in its page-locked memory (CUDA).
    #[serde(default)]
    pub staged_pinned: bool,
}

/// [`CrossingRates`] on `device`: for each kind, the median of `rounds` crossings, each timed
/// from the call to the data's arrival (a write is followed by a sync of the device). A read
/// starts from a tensor whose kernels have finished, so the figure is the crossing's own, not
/// the wait for the kernels that produce it, which a step's crossing also holds. Fails, saying
/// why, where the device cannot hold a tensor of `bytes` bytes.
pub fn crossing_rates(
    device: &Device,
    bytes: usize,
    rounds: usize,
) -> Result<CrossingRates, String> {
    let n = (bytes / 4).max(1);
    let cannot = |e: &dyn std::fmt::Debug| {
        format!(
            "the device cannot hold a tensor of {} bytes: {}",
            n * 4,
            crate::error::innermost_cause(e)
        )
    };
    let sync = || device.sync().map_err(|e| cannot(&e));
    // One crossing that reports a failure instead of panicking, as the engine's do, before
    // anything of the size is made on the host.
    let probe = Tensor::<1>::zeros([n], (device, DType::F32));
    sync()?;
    probe.try_into_data().map_err(|e| cannot(&e))?;
    let f32s: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.25).collect();
    let bf16s: Vec<Bf16> = (0..2 * n)
        .map(|i| Bf16::from_f32((i % 1000) as f32))
        .collect();
    let rounds = rounds.max(1);
    // A write's values are filled into its staged memory untimed, as MPI's receive fills it.
    let staged_f32 = || {
        let mut s = Staged::new::<f32>(n, device);
        s.values_mut().copy_from_slice(&f32s);
        s
    };
    let staged_bf16 = || {
        let mut s = Staged::new::<Bf16>(2 * n, device);
        s.values_mut().copy_from_slice(&bf16s);
        s
    };
    let staged_pinned = Staged::new::<f32>(n, device).is_pinned();
    let to_device_f32 = timed_write(rounds, &sync, staged_f32, Staged::upload)?;
    let to_host_f32 = timed_read(rounds, &sync, || from_f32(f32s.clone(), device), read_f32)?;
    let to_device_bf16 = timed_write(rounds, &sync, staged_bf16, Staged::upload)?;
    let to_host_bf16 = timed_read(rounds, &sync, || from_bf16(&bf16s, device), read_bf16)?;
    let rate = |seconds: f64| (n * 4) as f64 / seconds;
    Ok(CrossingRates {
        bytes: (n * 4) as u64,
        to_host_f32: rate(to_host_f32),
        to_device_f32: rate(to_device_f32),
        to_host_bf16: rate(to_host_bf16),
        to_device_bf16: rate(to_device_bf16),
        staged_pinned,
    })
}

/// The median seconds of `rounds` writes: each from its call (`write` of what `prepare` made,
/// untimed) to the device's having it. The tensor is let go after the clock is read.
fn timed_write<P>(
    rounds: usize,
    sync: &dyn Fn() -> Result<(), String>,
    prepare: impl Fn() -> P,
    write: impl Fn(P) -> Tensor<1>,
) -> Result<f64, String> {
    median_of(rounds, || {
        let input = prepare();
        let start = Instant::now();
        let t = write(input);
        sync()?;
        let s = start.elapsed().as_secs_f64();
        drop(t);
        Ok(s)
    })
}

/// The median seconds of `rounds` reads of a tensor `make` wrote and the device finished;
/// the values read are let go after the clock is read.
fn timed_read<R>(
    rounds: usize,
    sync: &dyn Fn() -> Result<(), String>,
    make: impl Fn() -> Tensor<1>,
    read: impl Fn(Tensor<1>) -> R,
) -> Result<f64, String> {
    median_of(rounds, || {
        let t = make();
        sync()?;
        let start = Instant::now();
        let values = read(t);
        let s = start.elapsed().as_secs_f64();
        drop(std::hint::black_box(values));
        Ok(s)
    })
}

/// The median of `rounds` results of `f`, or its first error.
fn median_of(rounds: usize, mut f: impl FnMut() -> Result<f64, String>) -> Result<f64, String> {
    let mut v = (0..rounds).map(|_| f()).collect::<Result<Vec<_>, _>>()?;
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_keep_every_bit() {
        round_trips_on(Device::flex());
        #[cfg(feature = "wgpu")]
        round_trips_on(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice));
    }

    /// Staged memory filled and written up gives the device the values it holds, in f32 and
    /// bf16, on every device (where the runtime stages nothing of its own, a vector).
    #[test]
    fn staged_values_go_up_as_filled() {
        staged_on(Device::flex());
        #[cfg(feature = "wgpu")]
        staged_on(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice));
    }

    fn staged_on(device: Device) {
        let v: Vec<f32> = (0..1003).map(|i| (i as f32 - 500.0) / 7.0).collect();
        let mut s = Staged::new::<f32>(v.len(), &device);
        assert!(!s.is_pinned(), "no page-locked memory off CUDA");
        s.values_mut().copy_from_slice(&v);
        let t = s.upload();
        assert_eq!(t.dtype(), DType::F32);
        assert_eq!(to_f32(t).unwrap(), v);
        if device.supports_dtype(DType::BF16) {
            let b: Vec<Bf16> = v.iter().map(|&x| Bf16::from_f32(x)).collect();
            let mut s = Staged::new::<Bf16>(b.len(), &device);
            s.values_mut().copy_from_slice(&b);
            assert_eq!(s.values::<Bf16>(), &b[..]);
            let t = s.upload();
            assert_eq!(t.dtype(), DType::BF16);
            assert_eq!(&read_bf16(t).unwrap()[..], &b[..]);
        }
        assert_eq!(Staged::new::<f32>(0, &device).upload().dims(), [0]);
    }

    fn round_trips_on(device: Device) {
        let mut v = vec![1.5f32, -0.0, f32::MIN_POSITIVE, 3.0e38];
        v.extend((0..1001).map(|i| (i as f32 - 500.0) / 7.0));
        assert_eq!(to_f32(from_f32(v.clone(), &device)).unwrap(), v);
        assert_eq!(&read_f32(from_f32(v.clone(), &device)).unwrap()[..], &v[..]);
        if device.supports_dtype(DType::BF16) {
            let b: Vec<Bf16> = v.iter().map(|&x| Bf16::from_f32(x)).collect();
            let t = from_bf16(&b, &device);
            assert_eq!(t.dtype(), DType::BF16);
            assert_eq!(&read_bf16(t.clone()).unwrap()[..], &b[..]);
            assert_eq!(to_bf16(t).unwrap(), b);
            // An f32 tensor read as bf16 is cast on its device first, rounding to nearest even.
            let cast = read_bf16(from_f32(v.clone(), &device)).unwrap();
            assert_eq!(&cast[..], &b[..]);
        }
    }

    /// A tensor the device could not allocate (1 GiB, past wgpu's buffer limit) reads back as
    /// the device's error, naming the cause, for the step to report, not as a panic.
    #[cfg(feature = "wgpu")]
    #[test]
    fn a_read_the_device_cannot_serve_is_an_error() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        let t = Tensor::<1>::ones([1 << 28], (&device, DType::F32));
        match to_f32(t.clone()) {
            Err(ShardError::Device(why)) => assert!(!why.is_empty()),
            other => panic!("a 1 GiB tensor on wgpu: {:?}", other.map(|v| v.len())),
        }
        assert!(matches!(to_bf16(t.clone()), Err(ShardError::Device(_))));
        assert!(matches!(read_f32(t.clone()), Err(ShardError::Device(_))));
        assert!(matches!(read_bf16(t), Err(ShardError::Device(_))));
    }

    /// A read's clock holds the copy: a CubeCL runtime reads lazily, at the data's first
    /// access, so the read the engine times must make that access itself. 64 MiB computed on
    /// the device arrive inside `read_f32`'s call: summing them afterwards takes less time
    /// than the call did (a lazy read would return at once and cross during the sum). The
    /// counters are process-wide and other tests cross beside this one, so only this thread's
    /// clock is held exactly.
    #[cfg(feature = "wgpu")]
    #[test]
    fn reads_cross_inside_their_own_calls() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        let n = 16 << 20;
        let t = Tensor::<1>::ones([n], (&device, DType::F32)) * 3.0;
        Staging::take();
        let start = Instant::now();
        let values = read_f32(t).unwrap();
        let call = start.elapsed().as_secs_f64();
        let taken = Staging::take();
        let start = Instant::now();
        let sum: f64 = values.iter().map(|&x| f64::from(x)).sum();
        let after = start.elapsed().as_secs_f64();
        assert_eq!(sum, 3.0 * n as f64);
        assert!(
            after < call,
            "{after} s to sum the values after a read of {call} s"
        );
        assert!(taken.to_host_bytes >= (n * 4) as u64);
        assert!(taken.this_thread_seconds > 0.0 && taken.this_thread_seconds <= call);
    }
}
