//! One Megatron sequence-parallel layer step (Korthikanti et al. 2022, §4.2.2), two ways:
//!
//! 1. **intra-node kernel** (`SeqParallelGroup`): all `W` ranks' buffers on one device — the
//!    GPU if there is one, else the host emulation (which runs every rank's blocks at once, so
//!    the cross-rank flag waits really happen);
//! 2. **NCCL** (`--features nccl`, one GPU per rank): this program spawns itself `W` times
//!    (`--rank r`), rank 0's NCCL unique id shared through a temp file; each process runs the
//!    same step on its GPU and writes its shard back; the parent compares with path 1.
//!
//! The step, for every rank `r` of a tensor-parallel group of `W`:
//!
//! ```text
//! y_r   = partial output of the row-parallel linear on rank r        [S, B, H]  (each rank: a partial sum)
//! z_r   = reduce_scatter(y)[rows of r] + bias + residual_r           [S_r, B, H] (g-bar, fused epilogue)
//!         … LayerNorm / dropout would run here, on the shard only …
//! x     = all_gather(z)                                              [S, B, H]  (g, before the next column-parallel linear)
//! ```
//!
//! With fewer GPUs than ranks the NCCL part explains itself and is skipped (exit code 0).
//!
//! ```sh
//! cargo run --release --example seq_parallel                      # intra-node (GPU or emulator)
//! cargo run --release --example seq_parallel --features nccl      # + NCCL, W = number of GPUs (2..=8)
//! ```
use std::process::ExitCode;

use half::bf16;
use mesa_kernels::reference::collectives as rc;
use mesa_kernels::{Device, Epilogue, SeqParallelGroup, SeqSplits, TensorMut, TensorRef};

/// Errors of this example: the crate's, and I/O and process failures around the NCCL ranks.
type AppResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Sequence, batch, hidden (a small layer: the emulation must finish in a moment).
const S: usize = 10; // not divisible by 4: shards 3, 3, 2, 2
const B: usize = 2;
const H: usize = 64;

/// Deterministic data of rank `r` (the same in every process): a hash, mapped to [-1, 1).
fn data(tag: u64, rank: usize, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|i| {
            let mut z = (tag << 40) ^ ((rank as u64) << 32) ^ i as u64;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            bf16::from_f32(scale * ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0))
        })
        .collect()
}

/// One vector per rank.
type PerRank = Vec<Vec<bf16>>;

struct Step {
    partial: Vec<Vec<bf16>>,
    bias: Vec<bf16>,
    residual: Vec<Vec<bf16>>,
}

fn step_data(world: usize, splits: &SeqSplits) -> Step {
    Step {
        partial: (0..world).map(|r| data(1, r, S * B * H, 2.0)).collect(),
        bias: data(2, 0, H, 0.5),
        residual: (0..world).map(|r| data(3, r, splits.rows(r) * B * H, 1.0)).collect(),
    }
}

/// The layer step through the intra-node kernel; returns (shards z_r, gathered x_r).
fn intra_node(device: &Device, world: usize, splits: &SeqSplits, step: &Step) -> AppResult<(PerRank, PerRank)> {
    let mut group = SeqParallelGroup::new(device, world)?;
    let inputs = step.partial.iter().map(|x| device.upload(x)).collect::<mesa_kernels::Result<Vec<_>>>()?;
    let biases = (0..world).map(|_| device.upload(&step.bias)).collect::<mesa_kernels::Result<Vec<_>>>()?;
    let residuals = step.residual.iter().map(|x| device.upload(x)).collect::<mesa_kernels::Result<Vec<_>>>()?;
    let mut shards = (0..world)
        .map(|r| device.alloc_zeros::<bf16>(splits.rows(r) * B * H))
        .collect::<mesa_kernels::Result<Vec<_>>>()?;
    let mut gathered =
        (0..world).map(|_| device.alloc_zeros::<bf16>(S * B * H)).collect::<mesa_kernels::Result<Vec<_>>>()?;
    {
        let ins: Vec<TensorRef<'_, bf16>> =
            inputs.iter().map(|x| TensorRef::contiguous(x, &[S, B, H])).collect::<mesa_kernels::Result<_>>()?;
        let bias: Vec<TensorRef<'_, bf16>> =
            biases.iter().map(|x| TensorRef::contiguous(x, &[H])).collect::<mesa_kernels::Result<_>>()?;
        let res: Vec<TensorRef<'_, bf16>> = residuals
            .iter()
            .enumerate()
            .map(|(r, x)| TensorRef::contiguous(x, &[splits.rows(r), B, H]))
            .collect::<mesa_kernels::Result<_>>()?;
        let mut outs: Vec<TensorMut<'_, bf16>> = shards
            .iter_mut()
            .enumerate()
            .map(|(r, x)| TensorMut::contiguous(x, &[splits.rows(r), B, H]))
            .collect::<mesa_kernels::Result<_>>()?;
        group.reduce_scatter_seq(&ins, &mut outs, splits, &Epilogue { bias: Some(&bias), residual: Some(&res) })?;
    }
    {
        let ins: Vec<TensorRef<'_, bf16>> = shards
            .iter()
            .enumerate()
            .map(|(r, x)| TensorRef::contiguous(x, &[splits.rows(r), B, H]))
            .collect::<mesa_kernels::Result<_>>()?;
        let mut outs: Vec<TensorMut<'_, bf16>> =
            gathered.iter_mut().map(|x| TensorMut::contiguous(x, &[S, B, H])).collect::<mesa_kernels::Result<_>>()?;
        group.all_gather_seq(&ins, &mut outs, splits)?;
    }
    group.check()?;
    let z = shards.iter().map(|b| b.to_vec()).collect::<mesa_kernels::Result<Vec<_>>>()?;
    let x = gathered.iter().map(|b| b.to_vec()).collect::<mesa_kernels::Result<Vec<_>>>()?;
    Ok((z, x))
}

/// Largest |a − b| as a fraction of the derived bound: one bf16 rounding (2⁻⁸·|b|) plus the
/// f32 accumulation of `terms` terms ((terms − 1)·2⁻²⁴·Σ|terms|, `mag`). ≤ 1 is correct.
fn max_error_vs_bound(a: &[bf16], b: &[f64], mag: &[f64], terms: usize) -> f64 {
    a.iter()
        .zip(b)
        .zip(mag)
        .map(|((x, y), m)| {
            let acc = (terms as f64 - 1.0) * 2f64.powi(-24) * m;
            (x.to_f64() - y).abs() / (2f64.powi(-8) * (y.abs() + acc) + acc).max(1e-300)
        })
        .fold(0.0, f64::max)
}

/// The f64 reference of the step and the Σ|terms| of every output element.
fn reference(world: usize, splits: &SeqSplits, step: &Step) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let run = |f: fn(f64) -> f64| {
        let map = |v: &[bf16]| v.iter().map(|x| f(x.to_f64())).collect::<Vec<f64>>();
        rc::reduce_scatter_seq(
            &step.partial.iter().map(|v| map(v)).collect::<Vec<_>>(),
            &splits.sizes(),
            B,
            H,
            Some(&vec![map(&step.bias); world]),
            Some(&step.residual.iter().map(|v| map(v)).collect::<Vec<_>>()),
        )
        .expect("the reference's lengths are the step's")
    };
    (run(|x| x), run(f64::abs))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Some(pos) = args.iter().position(|a| a == "--rank") {
        return child(&args, pos);
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("seq_parallel: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> AppResult<()> {
    println!("Megatron sequence parallelism: one layer step (reduce-scatter + bias + residual, then all-gather)");
    println!("[S, B, H] = [{S}, {B}, {H}] bf16, shards from explicit split sizes (S is not divisible by 4)\n");
    let device = Device::best_available();
    println!("1. intra-node kernel, all ranks on one device: {}", device.description());
    for world in [2usize, 4] {
        let splits = SeqSplits::even(S, world)?;
        let step = step_data(world, &splits);
        let (z, x) = intra_node(&device, world, &splits, &step)?;
        let (want, mags) = reference(world, &splits, &step);
        let err = (0..world).map(|r| max_error_vs_bound(&z[r], &want[r], &mags[r], world + 2)).fold(0.0, f64::max);
        let concat: Vec<bf16> = z.iter().flatten().copied().collect();
        let identical = x.iter().all(|g| g.iter().zip(&concat).all(|(a, b)| a.to_bits() == b.to_bits()));
        println!(
            "   W = {world}, shards {:?}: reduce-scatter error vs f64 reference = {err:.3} of its bound; \
             all-gather on every rank {} the concatenated shards",
            splits.sizes(),
            if identical { "bitwise equals" } else { "DIFFERS from" }
        );
        if !identical || err > 1.0 {
            return Err("intra-node result outside its bound".into());
        }
    }
    let (s, b, h, a, t) = (4096.0f64, 1.0, 8192.0, 64.0, 8.0);
    println!(
        "\n   activation memory per layer (Korthikanti et al. 2022, §4, 16-bit, s={s}, b={b}, h={h}, a={a}, t={t}):\n   \
         tensor parallel sbh(10 + 24/t + 5as/(ht)) = {:.0} MiB; + sequence parallel sbh/t(34 + 5as/h) = {:.0} MiB",
        s * b * h * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)) / 1048576.0,
        s * b * h / t * (34.0 + 5.0 * a * s / h) / 1048576.0
    );
    println!("\n2. NCCL backend, one process per GPU:");
    nccl_part()
}

#[cfg(not(feature = "nccl"))]
fn nccl_part() -> AppResult<()> {
    println!(
        "   built without the `nccl` feature; rerun with `--features nccl` (needs >= 2 GPUs and libnccl). Skipped."
    );
    Ok(())
}

#[cfg(not(feature = "nccl"))]
fn child(_args: &[String], _pos: usize) -> ExitCode {
    eprintln!("seq_parallel: --rank needs the `nccl` feature");
    ExitCode::FAILURE
}

#[cfg(feature = "nccl")]
fn gpu_count() -> usize {
    if !mesa_kernels::build::CUDA_BUILT || !mesa_kernels::Device::driver_library_present() {
        return 0;
    }
    std::panic::catch_unwind(cudarc::driver::CudaContext::device_count)
        .ok()
        .and_then(Result::ok)
        .map_or(0, |n| n.max(0) as usize)
}

#[cfg(feature = "nccl")]
fn nccl_part() -> AppResult<()> {
    use mesa_kernels::collectives::nccl::NcclUniqueId;
    use std::process::Command;
    let gpus = gpu_count();
    if gpus < 2 {
        println!(
            "   {gpus} GPU(s) visible: the NCCL step needs one GPU per rank and at least 2 ranks. Skipped \
             (the intra-node kernel above is the same step on one device)."
        );
        return Ok(());
    }
    let world = gpus.min(8);
    let id = match NcclUniqueId::new() {
        Ok(id) => id,
        Err(e) => {
            println!("   NCCL is not usable here ({e}). Skipped.");
            return Ok(());
        }
    };
    let dir = std::env::temp_dir().join(format!("mesa-seqpar-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("temp dir: {e}"))?;
    let id_file = dir.join("nccl-id");
    std::fs::write(&id_file, id.as_bytes()).map_err(|e| format!("id file: {e}"))?;
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    println!("   spawning {world} ranks (one per GPU), NCCL id in {}", id_file.display());
    let children: Vec<_> = (0..world)
        .map(|r| {
            Command::new(&exe)
                .args(["--rank", &r.to_string(), "--world", &world.to_string(), "--dir"])
                .arg(&dir)
                .spawn()
        })
        .collect();
    let mut ok = true;
    for c in children {
        match c.and_then(|mut c| c.wait()) {
            Ok(status) if status.success() => {}
            other => {
                println!("   a rank failed: {other:?}");
                ok = false;
            }
        }
    }
    if !ok {
        return Err("an NCCL rank failed".into());
    }
    let splits = SeqSplits::even(S, world)?;
    let step = step_data(world, &splits);
    let device = Device::cuda(0)?;
    let (z, x) = intra_node(&device, world, &splits, &step)?;
    let (want, mags) = reference(world, &splits, &step);
    let mut worst = 0.0f64;
    let mut bitwise = true;
    let mut nccl_shards: Vec<Vec<bf16>> = Vec::new();
    let mut nccl_gathered: Vec<Vec<bf16>> = Vec::new();
    for r in 0..world {
        let bytes = std::fs::read(dir.join(format!("rank{r}.bin"))).map_err(|e| format!("{e}"))?;
        let got: Vec<bf16> = bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect();
        let (shard, gathered) = got.split_at(splits.rows(r) * B * H);
        bitwise &= shard.iter().zip(&z[r]).all(|(a, b)| a.to_bits() == b.to_bits());
        worst = worst.max(max_error_vs_bound(shard, &want[r], &mags[r], world + 2));
        nccl_shards.push(shard.to_vec());
        nccl_gathered.push(gathered.to_vec());
    }
    // the NCCL all-gather must be the bit copy of the NCCL shards on every rank, as the
    // intra-node one is of its own (x holds the intra-node gathers)
    let concat: Vec<bf16> = nccl_shards.iter().flatten().copied().collect();
    let gather_ok = nccl_gathered.iter().all(|g| g.iter().zip(&concat).all(|(a, b)| a.to_bits() == b.to_bits()))
        && x.iter().all(|g| g.len() == concat.len());
    println!(
        "   NCCL all-gather on every rank {} the concatenated NCCL shards",
        if gather_ok { "bitwise equals" } else { "DIFFERS from" }
    );
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "   W = {world}: NCCL (f32 accumulation) vs the intra-node kernel: {}, NCCL error vs f64 reference = {worst:.3} of its bound",
        if bitwise { "bitwise identical" } else { "not bitwise identical (NCCL sums in its own order)" }
    );
    if worst > 1.0 || !gather_ok {
        return Err("NCCL result outside its bound".into());
    }
    Ok(())
}

/// A rank process: joins the communicator, runs the step on GPU `rank`, writes shard + gathered.
#[cfg(feature = "nccl")]
fn child(args: &[String], pos: usize) -> ExitCode {
    use mesa_kernels::collectives::nccl::{NcclSeqParallel, NcclUniqueId, ShardEpilogue};
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let rank: usize = args.get(pos + 1).and_then(|s| s.parse().ok()).unwrap_or(usize::MAX);
    let world: usize = arg("--world").and_then(|s| s.parse().ok()).unwrap_or(0);
    let Some(dir) = arg("--dir").map(std::path::PathBuf::from) else {
        eprintln!("rank: --dir missing");
        return ExitCode::FAILURE;
    };
    let result = (|| -> AppResult<()> {
        let bytes = std::fs::read(dir.join("nccl-id")).map_err(|e| format!("{e}"))?;
        let id = NcclUniqueId::from_bytes(&bytes)?;
        let device = Device::cuda(rank)?;
        let mut comm = NcclSeqParallel::new(&device, rank, world, &id)?;
        let splits = SeqSplits::even(S, world)?;
        let step = step_data(world, &splits);
        let rows = splits.rows(rank);
        let input = device.upload(&step.partial[rank])?;
        let bias = device.upload(&step.bias)?;
        let residual = device.upload(&step.residual[rank])?;
        let mut shard = device.alloc_zeros::<bf16>(rows * B * H)?;
        let mut gathered = device.alloc_zeros::<bf16>(S * B * H)?;
        let (bias, residual) = (TensorRef::contiguous(&bias, &[H])?, TensorRef::contiguous(&residual, &[rows, B, H])?);
        comm.reduce_scatter_seq(
            &TensorRef::contiguous(&input, &[S, B, H])?,
            &mut TensorMut::contiguous(&mut shard, &[rows, B, H])?,
            &splits,
            &ShardEpilogue { bias: Some(&bias), residual: Some(&residual) },
        )?;
        comm.all_gather_seq(
            &TensorRef::contiguous(&shard, &[rows, B, H])?,
            &mut TensorMut::contiguous(&mut gathered, &[S, B, H])?,
            &splits,
        )?;
        let mut out: Vec<u8> = Vec::new();
        for v in shard.to_vec()?.into_iter().chain(gathered.to_vec()?) {
            out.extend_from_slice(&v.to_le_bytes());
        }
        std::fs::write(dir.join(format!("rank{rank}.bin")), out)?;
        Ok(())
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}
