//! The quantization kernels written once in CubeCL (`#[cube]`) and launched on the client of
//! whatever runtime the data lives on (wgpu, CUDA or HIP: features `wgpu`, `cuda`, `rocm`). Same
//! numerics as `reference`; it deliberately keeps host <-> device copies to the thin
//! [`QuantKernels`] adapter at the bottom, which exists for host-resident buffers and tests.
//!
//! Storage is u32 words only: WGSL has no 8-bit storage, so int8 values are packed four to a
//! word and int4 eight to a word (little-endian, the same bytes as the host layout), and scales
//! travel as their f32 bit patterns so no kernel ever materialises a NaN constant (WGSL forbids
//! them in constant expressions).

use cubecl::prelude::*;
pub use cubecl::server::Handle;

use super::{BlockSize, QuantFormat, QuantKernels, Quantized};

/// Bits below which a magnitude is subnormal (or zero): such values are read and written as
/// zeros (`quant`'s numerics), whether or not the device flushes them itself.
const MIN_NORMAL: u32 = 0x0080_0000;
/// `reference::SCALE_DROPPED_BITS` low mantissa bits, and the mask that clears them.
const SCALE_LOW: u32 = (1 << super::reference::SCALE_DROPPED_BITS) - 1;
const SCALE_KEEP: u32 = !SCALE_LOW;

/// One unit per block of the first `len` elements of `input`: `scales[b]` = bits of
/// `amax / qmax` rounded up to 16 significant bits, 0 below the normal range, or a quiet NaN's
/// bits for a block holding a non-finite value.
///
/// Every kernel here is told its element count: a buffer's `len()` in a kernel is the length
/// of the memory it is bound to, which can run past the tensor (a CUDA allocation rounded up,
/// a view into a larger buffer).
// CubeCL kernels loop over ranges: iterator adaptors don't exist inside `#[cube]`.
#[allow(clippy::needless_range_loop)]
#[cube(launch_unchecked, create_dummy_kernel)]
pub fn block_scales(
    input: &[f32],
    scales: &mut [u32],
    len: usize,
    #[comptime] block: usize,
    #[comptime] qmax: u32,
) {
    let b = ABSOLUTE_POS;
    if b < len.div_ceil(block) {
        let start = b * block;
        let end = min(start + block, len);
        let mut amax = 0u32;
        for i in start..end {
            amax = max(amax, u32::reinterpret(input[i]) & 0x7fff_ffffu32);
        }
        let mut bits = 0u32;
        if amax >= 0x7f80_0000u32 {
            bits = 0x7fc0_0000u32;
        } else if amax >= MIN_NORMAL {
            let scale = u32::reinterpret(f32::reinterpret(amax) / f32::cast_from(qmax));
            if scale >= MIN_NORMAL {
                bits = (scale + SCALE_LOW) & SCALE_KEEP;
            }
        }
        scales[b] = bits;
    }
}

/// One unit per output word: quantizes `32 / width` consecutive elements of the first `len`
/// and packs them.
#[cube(launch_unchecked, create_dummy_kernel)]
pub fn quantize_pack(
    input: &[f32],
    scales: &[u32],
    out: &mut [u32],
    len: usize,
    #[comptime] block: usize,
    #[comptime] qmax: u32,
    #[comptime] width: u32,
) {
    let w = ABSOLUTE_POS;
    let per_word = comptime!((32 / width) as usize);
    if w < len.div_ceil(per_word) {
        let mask = comptime!((1u32 << width) - 1);
        let limit = f32::cast_from(qmax);
        let mut word = 0u32;
        #[unroll]
        for j in 0..per_word {
            let i = w * per_word + j;
            if i < len {
                let sbits = scales[i / block];
                let mut q = 0i32;
                // Finite and non-zero: scales are never negative, so the bits order like values.
                // A subnormal input quantizes to 0.
                let normal = (u32::reinterpret(input[i]) & 0x7fff_ffffu32) >= MIN_NORMAL;
                if sbits != 0u32 && sbits < 0x7f80_0000u32 && normal {
                    let y = f32::round(input[i] / f32::reinterpret(sbits));
                    q = i32::cast_from(max(min(y, limit), -limit));
                }
                let shift = comptime!(j as u32 * width);
                word |= (u32::reinterpret(q) & mask) << shift;
            }
        }
        out[w] = word;
    }
}

/// One unit per element of `len`: sums `q * scale` over `parts` quantized buffers of `len`
/// elements laid end to end (their packed words, then their scales), in part order from 0,
/// each partial sum below the normal range made a zero of its sign. The product is exact (16-bit
/// scales), so a compiler that fuses it with the add into an FMA changes nothing.
#[cube(launch_unchecked, create_dummy_kernel)]
pub fn dequantize_sum_kernel(
    data: &[u32],
    scales: &[u32],
    out: &mut [f32],
    len: usize,
    #[comptime] parts: usize,
    #[comptime] block: usize,
    #[comptime] width: u32,
) {
    let i = ABSOLUTE_POS;
    let per_word = comptime!((32 / width) as usize);
    if i < len {
        let mask = comptime!((1u32 << width) - 1);
        let words_per_part = len.div_ceil(per_word);
        let scales_per_part = len.div_ceil(block);
        let shift = u32::cast_from(i % per_word) * width;
        let mut acc = 0.0f32;
        for p in 0..parts {
            let raw = (data[p * words_per_part + i / per_word] >> shift) & mask;
            // Move the value's sign bit to bit 31, then shift back arithmetically.
            let q = i32::reinterpret(raw << (32 - width)) >> i32::cast_from(32 - width);
            let scale = f32::reinterpret(scales[p * scales_per_part + i / block]);
            acc += f32::cast_from(q) * scale;
            let bits = u32::reinterpret(acc);
            if (bits & 0x7fff_ffffu32) < MIN_NORMAL {
                acc = f32::reinterpret(bits & 0x8000_0000u32);
            }
        }
        out[i] = acc;
    }
}

/// The kernels on one CubeCL client.
pub struct CubeKernels {
    client: cubecl::client::Client,
    name: String,
}

impl std::fmt::Debug for CubeKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CubeKernels")
            .field("name", &self.name)
            .finish()
    }
}

/// CUDA GPU `index`, or why this machine cannot give it: no NVIDIA driver library, or fewer
/// GPUs than that. Asked before anything loads the driver: CubeCL's CUDA runtime panics when
/// it cannot, where this answers with what to do.
#[cfg(feature = "cuda")]
pub fn cuda_device(index: usize) -> Result<cubecl::Device, String> {
    use cubecl::device::DeviceUnavailable;
    cubecl::Device::cuda(index).map_err(|e| match e {
        DeviceUnavailable::NoSuchDevice { available: 0, .. } if !cuda_driver_present() => {
            "no NVIDIA driver on this machine (libcuda.so.1 cannot be loaded): run on a machine \
             with an NVIDIA GPU and its driver (nvidia-smi lists the GPUs), or choose another \
             --device such as flex"
                .to_string()
        }
        DeviceUnavailable::NoSuchDevice { available, .. } => format!(
            "there is no CUDA GPU {index}: the driver reports {available} (nvidia-smi lists \
             them; indices start at 0)"
        ),
        e => e.to_string(),
    })
}

/// Whether the NVIDIA driver's library loads (the names cudarc tries first).
#[cfg(feature = "cuda")]
fn cuda_driver_present() -> bool {
    [c"libcuda.so.1", c"libcuda.so"].iter().any(|name| {
        // SAFETY: dlopen of a driver library runs its initialisers only, and the handle is
        // closed at once; a null return means it could not be loaded.
        unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if handle.is_null() {
                return false;
            }
            libc::dlclose(handle);
            true
        }
    })
}

const CUBE_DIM: u32 = 256;

/// The quantization kernels as the quantized collectives launch them, int8 and int4 at the
/// default block, sums of 1, 2 and 8 parts, defined for `target` without a client
/// ([`crate::ahead`]).
pub fn ahead(target: &crate::ahead::Target) -> crate::ahead::Kernels {
    use crate::ahead::buffer_arg;
    let (device, props) = (&target.device, &target.target);
    let block = BlockSize::DEFAULT.get();
    let len = 8 * block;
    let n_scales = len.div_ceil(block);
    let dim = CubeDim::new_1d(CUBE_DIM);
    let mut out: crate::ahead::Kernels = Vec::new();
    for format in [QuantFormat::Int8, QuantFormat::Int4] {
        let (qmax, n_words) = (format.qmax() as u32, words(format, len));
        out.push((
            format!("block_scales {format:?}"),
            Box::new(block_scales::create_dummy_kernel(
                device.clone(),
                props.clone(),
                cube_count(n_scales),
                dim,
                buffer_arg(len, 4),
                buffer_arg(n_scales, 4),
                len,
                block,
                qmax,
            )),
        ));
        out.push((
            format!("quantize_pack {format:?}"),
            Box::new(quantize_pack::create_dummy_kernel(
                device.clone(),
                props.clone(),
                cube_count(n_words),
                dim,
                buffer_arg(len, 4),
                buffer_arg(n_scales, 4),
                buffer_arg(n_words, 4),
                len,
                block,
                qmax,
                width(format),
            )),
        ));
        for parts in [1, 2, 8] {
            out.push((
                format!("dequantize_sum {format:?} of {parts}"),
                Box::new(dequantize_sum_kernel::create_dummy_kernel(
                    device.clone(),
                    props.clone(),
                    cube_count(len),
                    dim,
                    buffer_arg(parts * n_words, 4),
                    buffer_arg(parts * n_scales, 4),
                    buffer_arg(len, 4),
                    len,
                    parts,
                    block,
                    width(format),
                )),
            ));
        }
    }
    out
}

fn cube_count(units: usize) -> CubeCount {
    // Spread over x and y: x is limited to 65535 cubes on most runtimes.
    let cubes = (units as u32).div_ceil(CUBE_DIM).max(1);
    let x = cubes.min(65_535);
    CubeCount::Static(x, cubes.div_ceil(x), 1)
}

fn words(format: QuantFormat, len: usize) -> usize {
    match format {
        QuantFormat::Int8 => len.div_ceil(4),
        QuantFormat::Int4 => len.div_ceil(8),
    }
}

fn width(format: QuantFormat) -> u32 {
    match format {
        QuantFormat::Int8 => 8,
        QuantFormat::Int4 => 4,
    }
}

fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

impl CubeKernels {
    /// The kernels on the default wgpu device (Vulkan/Metal/DX12; Mesa lavapipe in CI).
    #[cfg(feature = "wgpu")]
    pub fn wgpu() -> Result<Self, String> {
        let device = cubecl::Device::wgpu(Default::default()).map_err(|e| {
            format!("no wgpu device ({e:?}): install a Vulkan driver (Debian: mesa-vulkan-drivers)")
        })?;
        Ok(Self::on(device.client(), "wgpu"))
    }

    /// The kernels on CUDA GPU `index`; an error (not CubeCL's panic) without one.
    #[cfg(feature = "cuda")]
    pub fn cuda(index: usize) -> Result<Self, String> {
        let device = cuda_device(index)?;
        Ok(Self::on(device.client(), &format!("cuda:{index}")))
    }

    /// The kernels on an existing client (e.g. the one a Burn device uses).
    pub fn on(client: cubecl::client::Client, name: &str) -> Self {
        Self {
            client,
            name: name.to_string(),
        }
    }

    /// Quantizes the `len` f32 values of `input`, a buffer on this client, blockwise. Only the
    /// packed values and the scales come back to the host: the bytes a collective sends. The
    /// error is the device's, where it could not run the kernels or read their output back (a
    /// buffer it could not allocate, `input`'s included).
    pub fn quantize_device(
        &self,
        input: Handle,
        len: usize,
        format: QuantFormat,
        block: BlockSize,
    ) -> Result<Quantized, String> {
        self.quantize_and_dequantize(input, len, format, block, None)
    }

    /// [`quantize_device`](Self::quantize_device), and the quantized values dequantized into
    /// `back`, a buffer of `len` f32 on this client, from the packed bytes and scales where the
    /// kernels wrote them: the same bits as [`QuantKernels::dequantize`] of the result, without
    /// its bytes crossing back to the device (what an error-feedback residual needs).
    pub fn quantize_device_and_back(
        &self,
        input: Handle,
        len: usize,
        format: QuantFormat,
        block: BlockSize,
        back: Handle,
    ) -> Result<Quantized, String> {
        self.quantize_and_dequantize(input, len, format, block, Some(back))
    }

    fn quantize_and_dequantize(
        &self,
        input: Handle,
        len: usize,
        format: QuantFormat,
        block: BlockSize,
        back: Option<Handle>,
    ) -> Result<Quantized, String> {
        if len == 0 {
            return Ok(Quantized {
                format,
                block,
                len: 0,
                data: Vec::new(),
                scales: Vec::new(),
            });
        }
        let n_scales = len.div_ceil(block.get());
        let n_words = words(format, len);
        let client = &self.client;
        let scales_h = client.empty(n_scales * 4);
        let out_h = client.empty(n_words * 4);
        let qmax = format.qmax() as u32;
        // SAFETY: every index the kernels read or write is bounds-checked against the buffer
        // lengths passed alongside the handles, which are the handles' true lengths.
        unsafe {
            block_scales::launch_unchecked(
                client,
                cube_count(n_scales),
                CubeDim::new_1d(CUBE_DIM),
                BufferArg::from_raw_parts(input.clone(), len),
                BufferArg::from_raw_parts(scales_h.clone(), n_scales),
                len,
                block.get(),
                qmax,
            );
            quantize_pack::launch_unchecked(
                client,
                cube_count(n_words),
                CubeDim::new_1d(CUBE_DIM),
                BufferArg::from_raw_parts(input, len),
                BufferArg::from_raw_parts(scales_h.clone(), n_scales),
                BufferArg::from_raw_parts(out_h.clone(), n_words),
                len,
                block.get(),
                qmax,
                width(format),
            );
            if let Some(back) = back {
                dequantize_sum_kernel::launch_unchecked(
                    client,
                    cube_count(len),
                    CubeDim::new_1d(CUBE_DIM),
                    BufferArg::from_raw_parts(out_h.clone(), n_words),
                    BufferArg::from_raw_parts(scales_h.clone(), n_scales),
                    BufferArg::from_raw_parts(back, len),
                    len,
                    1,
                    block.get(),
                    width(format),
                );
            }
        }
        // Both buffers in one read: one wait for the kernels, one copy back.
        let [scales, data]: [_; 2] = client
            .read(vec![scales_h, out_h])
            .map_err(|e| format!("reading quantized bytes back from the device: {e:?}"))?
            .try_into()
            .map_err(|v: Vec<_>| format!("the device read back {} buffers of 2", v.len()))?;
        let mut data = data.to_vec();
        let scales = u32::from_bytes(&scales)
            .iter()
            .map(|&b| f32::from_bits(b))
            .collect();
        data.truncate(format.data_bytes(len));
        Ok(Quantized {
            format,
            block,
            len,
            data,
            scales,
        })
    }

    /// Writes the element-wise sum of the dequantized `parts` (same format, block and length
    /// `len`), added in part order from zero, into `out`, a buffer of `len` f32 on this client.
    /// Only the received bytes go to the device.
    pub fn dequantize_sum_device(&self, parts: &[Quantized], out: Handle) {
        let Some(first) = parts.first() else {
            return;
        };
        let (format, block, len) = (first.format, first.block, first.len);
        if len == 0 {
            return;
        }
        let mut data = Vec::new();
        let mut scales = Vec::new();
        for p in parts {
            assert!(
                p.format == format && p.block == block && p.len == len,
                "parts agree"
            );
            data.extend(u32s(&p.data));
            scales.extend(p.scales.iter().map(|s| s.to_bits()));
        }
        let client = &self.client;
        let (n_words, n_scales) = (data.len(), scales.len());
        // The vectors handed over as they are (one host copy fewer than from a slice).
        let data_h = client.create(cubecl::bytes::Bytes::from_elems(data));
        let scales_h = client.create(cubecl::bytes::Bytes::from_elems(scales));
        // SAFETY: as in `quantize_device`.
        unsafe {
            dequantize_sum_kernel::launch_unchecked(
                client,
                cube_count(len),
                CubeDim::new_1d(CUBE_DIM),
                BufferArg::from_raw_parts(data_h, n_words),
                BufferArg::from_raw_parts(scales_h, n_scales),
                BufferArg::from_raw_parts(out, len),
                len,
                parts.len(),
                block.get(),
                width(format),
            );
        }
    }

    fn dequantize_parts(&self, parts: &[Quantized]) -> Vec<f32> {
        let len = parts.first().map_or(0, |p| p.len);
        if len == 0 {
            return Vec::new();
        }
        let out_h = self.client.empty(len * 4);
        self.dequantize_sum_device(parts, out_h.clone());
        f32::from_bytes(&self.client.read_one_unchecked(out_h)).to_vec()
    }
}

impl QuantKernels for CubeKernels {
    fn name(&self) -> String {
        self.name.clone()
    }

    /// A device failure stops the check that called it, named (the trait has no error).
    fn quantize(&self, x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized {
        let input = match x.is_empty() {
            true => self.client.empty(4),
            false => self.client.create_from_slice(f32::as_bytes(x)),
        };
        self.quantize_device(input, x.len(), format, block)
            .unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }

    fn dequantize(&self, q: &Quantized) -> Vec<f32> {
        self.dequantize_parts(std::slice::from_ref(q))
    }

    fn dequantize_sum(&self, parts: &[Quantized]) -> Vec<f32> {
        self.dequantize_parts(parts)
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use crate::quant::host::HostKernels;

    /// Kernels handed a buffer longer than the values they are told of (as a CUDA allocation
    /// rounded up, or a view into a larger buffer, gives them) quantize and write those values
    /// only: the tail, 1000 times larger, touches neither a scale nor a packed word, and the
    /// output's tail keeps what it held.
    #[test]
    fn a_buffer_longer_than_its_values_is_read_and_written_only_as_far_as_told() {
        let kernels = CubeKernels::wgpu().expect("the wgpu feature is on");
        let big: Vec<f32> = (0..2048)
            .map(|i| ((i * 37 % 1001) as f32 - 500.0) / if i < 1100 { 97.0 } else { 0.097 })
            .collect();
        for len in [1000, 1003, 37] {
            for block in [8, 64, 2048] {
                let block = BlockSize::new(block).unwrap();
                for format in [QuantFormat::Int8, QuantFormat::Int4] {
                    let at = format!("{len} of 2048, {format:?}, {block:?}");
                    let input = kernels.client.create_from_slice(f32::as_bytes(&big));
                    let back = kernels.client.create_from_slice(f32::as_bytes(&big));
                    let q = kernels
                        .quantize_device_and_back(input, len, format, block, back.clone())
                        .unwrap();
                    let want = HostKernels.quantize(&big[..len], format, block);
                    assert!(q.bit_eq(&want), "{at}");
                    let back = f32::from_bytes(&kernels.client.read_one_unchecked(back)).to_vec();
                    assert!(back[..len] == HostKernels.dequantize(&want)[..], "{at}");
                    assert!(back[len..] == big[len..], "{at}: the tail is untouched");
                    let out = kernels.client.create_from_slice(f32::as_bytes(&big));
                    kernels.dequantize_sum_device(&[q.clone(), q], out.clone());
                    let sum = f32::from_bytes(&kernels.client.read_one_unchecked(out)).to_vec();
                    let parts = [want.clone(), want];
                    assert!(sum[..len] == HostKernels.dequantize_sum(&parts)[..], "{at}");
                    assert!(sum[len..] == big[len..], "{at}: the tail is untouched");
                }
            }
        }
    }

    /// Kernels handed a buffer the device could not allocate (1 GiB, past wgpu's buffer limit)
    /// answer with the device's error, not a panic.
    #[test]
    fn a_buffer_the_device_could_not_allocate_quantizes_to_an_error() {
        let kernels = CubeKernels::wgpu().expect("the wgpu feature is on");
        let block = BlockSize::new(64).unwrap();
        let input = kernels.client.empty(1 << 30);
        let err = kernels
            .quantize_device(input, 1 << 28, QuantFormat::Int8, block)
            .map(|q| q.len)
            .unwrap_err();
        assert!(err.contains("reading quantized bytes back"), "{err}");
    }
}
