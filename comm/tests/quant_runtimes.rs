//! Every quantization runtime present in this build (host always; the CubeCL kernels on wgpu
//! with `--features wgpu`) against the scalar reference, bit for bit, through the same check
//! `ember selftest` runs on a GPU (`quant::selfcheck`).

use ember_comm::quant::QuantKernels;
use ember_comm::quant::host::HostKernels;
use ember_comm::quant::selfcheck::check;

fn runtimes() -> Vec<Box<dyn QuantKernels>> {
    #[allow(unused_mut)]
    let mut out: Vec<Box<dyn QuantKernels>> = vec![Box::new(HostKernels)];
    #[cfg(feature = "wgpu")]
    out.push(Box::new(
        ember_comm::quant::cube::CubeKernels::wgpu()
            .expect("the wgpu feature is on, so a device must exist"),
    ));
    out
}

#[test]
fn every_runtime_is_bit_identical_to_the_scalar_reference() {
    for rt in runtimes() {
        let report = check(rt.as_ref());
        eprintln!("{}: {} comparisons", report.runtime, report.checks);
        assert!(
            report.passed(),
            "{}: {:#?}",
            report.runtime,
            report.failures
        );
    }
}
