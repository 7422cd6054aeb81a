//! Build script of mesa-kernels-sys: one kernel source, two builds.
//!
//! 1. Host emulation (always): every `kernels/*.cu` is compiled by the system C++20 compiler
//!    with `kernels/emu/cuda_emu.h` force-included, plus the emulator runtime, into the
//!    static library `mesa_kernels_emu` (entry points `mesa_emu_*`).
//! 2. CUDA (when nvcc is found): the same files through the `cc` crate's CUDA mode into
//!    `mesa_kernels_cuda_*` (entry points `mesa_*`), SASS for every listed architecture plus
//!    PTX for the highest, linked with the static CUDA runtime. Without nvcc, a generated
//!    stub makes every `mesa_*` entry point return `MESA_STATUS_CUDA_NOT_BUILT`, and the
//!    build prints a cargo warning.
//!
//! Environment:
//! * `NVCC`, then `CUDA_HOME`/`CUDA_PATH` (`bin/nvcc`), then `PATH`: which nvcc.
//! * `MESA_CUDA_ARCHS`: comma-separated compute capabilities, default `80,90`; accepted
//!   spellings `90`, `9.0`, `sm_90`, `compute_90`, `90a` (arch-specific, SASS only).
//!   PTX is embedded for the highest non-`a` entry.
//! * `MESA_CUDA_DISABLE=1`: build the emulation only, even if nvcc is present.
//! * `MESA_EMU_FP_CONTRACT=fast`: compile the emulation with FMA contraction on
//!   (`-ffp-contract=fast`, and `-mfma` on x86-64 even where the build host lacks FMA; by
//!   default `-mfma` only where it has it, so `fmaf` is one instruction) instead of off — a check, not a mode: the
//!   kernels write every rounding that matters explicitly (`fmaf`, `__fmul_rn`, `__fadd_rn`),
//!   so both builds must give bitwise the same results (`.ci/run` compares `tests/digests.rs`).
//! * `MESA_KERNELS_BUILD_CACHE=DIR`: keep every compiled archive (the emulation's, each CUDA
//!   file's) in DIR under a hash of all its inputs — every file under `kernels/`, this script,
//!   the compiler's path, `--version` and flags, the target — and reuse it when a build script
//!   run (another profile, feature set, target dir, or the packaged crate) has the same inputs.
//!   Off by default; `.ci/run` and `scripts/check-fast.sh` set it (docs/ci.md).
//! * `MESA_EMU_SANITIZE=address`: the emulation with AddressSanitizer; the package's test,
//!   bench and example binaries are then linked with the ASan runtime (they must run with it
//!   preloaded: docs/emulator.md).
//! * feature `regenerate-bindings`: run bindgen on `kernels/include/mesa_kernels.h` and
//!   fail if `src/bindings.rs` differs (`MESA_WRITE_BINDINGS=1` rewrites it instead).
use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const DEFAULT_ARCHS: &str = "80,90";

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels = manifest.join("kernels");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "MESA_CUDA_ARCHS",
        "MESA_CUDA_DISABLE",
        "MESA_WRITE_BINDINGS",
        "MESA_EMU_FP_CONTRACT",
        "MESA_EMU_SANITIZE",
        "MESA_KERNELS_BUILD_CACHE",
        "NVCC_PREPEND_FLAGS",
        "NVCC_APPEND_FLAGS",
        "NVCC_CCBIN",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let sources = kernel_sources(&kernels);
    let contract = match env::var("MESA_EMU_FP_CONTRACT").as_deref() {
        Err(_) | Ok("") | Ok("off") => "off",
        Ok("fast") => "fast",
        Ok(other) => fail(&format!("MESA_EMU_FP_CONTRACT=`{other}`: expected `off` (default) or `fast`")),
    };
    build_emulation(&kernels, &sources, contract, &out);

    let disabled = env::var("MESA_CUDA_DISABLE").is_ok_and(|v| v == "1");
    let cuda = if disabled { None } else { find_nvcc() };
    let (cuda_built, archs_text) = match cuda {
        Some(nvcc) => {
            let archs = match parse_archs(&env::var("MESA_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.into())) {
                Ok(a) => a,
                Err(msg) => fail(&format!("MESA_CUDA_ARCHS: {msg}")),
            };
            build_cuda(&nvcc, &kernels, &sources, &archs, &out);
            (true, archs.iter().map(|a| a.label()).collect::<Vec<_>>().join(","))
        }
        None => {
            let why =
                if disabled { "MESA_CUDA_DISABLE=1" } else { "nvcc not found (NVCC, CUDA_HOME, CUDA_PATH, PATH)" };
            println!(
                "cargo:warning=mesa-kernels-sys: {why}; building the host emulation only. \
                 CUDA entry points will return MESA_STATUS_CUDA_NOT_BUILT."
            );
            build_cuda_stub(&kernels, &out);
            (false, String::new())
        }
    };
    fs::write(
        out.join("build_info.rs"),
        format!(
            "/// True when the CUDA kernels were compiled (nvcc was found at build time).\n\
             pub const CUDA_BUILT: bool = {cuda_built};\n\
             /// The architectures compiled into the CUDA library (`sm_XX` = SASS, `compute_XX` = PTX).\n\
             pub const CUDA_ARCHS: &str = \"{archs_text}\";\n\
             /// FMA contraction of the emulation build (`MESA_EMU_FP_CONTRACT`): \"off\" or \"fast\".\n\
             pub const EMU_FP_CONTRACT: &str = \"{contract}\";\n"
        ),
    )
    .unwrap_or_else(|e| fail(&format!("cannot write build_info.rs: {e}")));

    #[cfg(feature = "regenerate-bindings")]
    regenerate_bindings(&manifest, &out);
}

fn fail(msg: &str) -> ! {
    eprintln!("error: mesa-kernels-sys build: {msg}");
    std::process::exit(1);
}

fn kernel_sources(kernels: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(kernels)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", kernels.display())))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    v.sort();
    v
}

fn build_emulation(kernels: &Path, sources: &[PathBuf], contract: &str, out: &Path) {
    // The emulator's copy of the sources: every `.cu`/`.cuh` with its shared-memory
    // declarations and launch bounds made visible to the checks (emu_rewrite).
    let emu_src = out.join("emu_src");
    let broken_dir = kernels.join("broken");
    for dir in [kernels, broken_dir.as_path()] {
        let Ok(entries) = fs::read_dir(dir) else { continue };
        let target = if dir == kernels { emu_src.clone() } else { emu_src.join("broken") };
        fs::create_dir_all(&target).unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", target.display())));
        // A copy whose source is gone (moved or deleted) must not stay: `#include "x.cuh"`
        // would find it first, and the build cache would store its object under a key that
        // a clean tree computes too.
        for old in fs::read_dir(&target).into_iter().flatten().filter_map(|e| e.ok()) {
            let name = old.file_name();
            if old.path().is_file() && !dir.join(&name).is_file() {
                let _ = fs::remove_file(old.path());
            }
        }
        for e in entries.filter_map(|e| e.ok()) {
            let p = e.path();
            if !p.extension().is_some_and(|x| x == "cu" || x == "cuh") {
                continue;
            }
            let text = fs::read_to_string(&p).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", p.display())));
            // the path as the package names it (`kernels/quantize.cu`): in the emulator's
            // reports, and the same object for the same source wherever the tree lies
            let shown = p.strip_prefix(kernels.parent().unwrap_or(kernels)).unwrap_or(&p);
            let rewritten = format!("#line 1 \"{}\"\n{}", shown.display(), emu_rewrite(&text));
            let dst = target.join(p.file_name().unwrap_or_default());
            if fs::read_to_string(&dst).ok().as_deref() != Some(rewritten.as_str()) {
                fs::write(&dst, rewritten).unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", dst.display())));
            }
        }
    }
    let base = |b: &mut cc::Build| {
        b.cpp(true)
            .std("c++20")
            .include(&emu_src)
            .include(kernels.join("include"))
            .include(kernels)
            .include(kernels.join("emu"))
            // Kernel semantics must not depend on the profile: always optimised, no contraction of
            // a*b+c into FMA (kernels write fmaf where they want one, as on the GPU), no
            // type-based aliasing (16-byte vector access reinterprets element arrays).
            .debug(false)
            .opt_level(2)
            .flag(if contract == "fast" { "-ffp-contract=fast" } else { "-ffp-contract=off" })
            .flag("-fno-strict-aliasing")
            .flag("-pthread")
            .warnings(false);
        if env::var("CARGO_CFG_TARGET_ARCH").is_ok_and(|a| a == "x86_64") && host_has_fma(contract == "fast") {
            // FMA instructions: the kernels' explicit fmaf becomes one instruction instead of a
            // library call (a fifth of the emulator's time in the linear-attention kernels),
            // and under `fast` contraction really fuses (aarch64 always has them). Rounding is
            // the same either way: fmaf is exact, and `off` forbids contracting a*b+c.
            b.flag("-mfma");
        }
        if let Some(flags) = sanitizer_flags() {
            for f in flags {
                b.flag(f);
            }
        }
    };
    let emu_header = kernels.join("emu").join("cuda_emu.h");
    let emu_header = emu_header.to_str().unwrap_or_else(|| fail("non-UTF-8 path")).to_string();
    // The kernels: GCC's -fsanitize=thread instrumentation of every memory access (no
    // ThreadSanitizer runtime: the emulator's own callbacks, a test of one flag when
    // racecheck is off). Not with AddressSanitizer, which excludes it.
    let instrument = |b: &mut cc::Build| {
        if sanitizer_flags().is_none() {
            b.flag("-fsanitize=thread").flag("--param=tsan-instrument-func-entry-exit=0");
        }
        // Line tables (no variables): racecheck's reports name the source lines of both
        // accesses (addr2line on the instrumented call's return address).
        b.flag("-g1");
        // The .cu files are C++ to the host compiler; the emulation header is force-included.
        b.flag("-include").flag(&emu_header);
        b.flag("-x").flag("c++");
    };
    let mut b = cc::Build::new();
    base(&mut b);
    instrument(&mut b);
    // The runtime, uninstrumented: it implements the racecheck callbacks the kernels call.
    let mut rt = cc::Build::new();
    base(&mut rt);
    let mut objects = cached_objects(&rt, &[kernels.join("emu").join("emu_runtime.cpp")]);
    let kernel_files: Vec<PathBuf> = sources.iter().map(|s| emu_src.join(s.file_name().unwrap_or_default())).collect();
    objects.extend(cached_objects(&b, &kernel_files));
    let lib = b.create_archive("mesa_kernels_emu", &objects);
    cc::emit_link_directives(&b, &lib);

    // The deliberately broken kernels of tests/sanitizer.rs (kernels/broken/): compiled for the
    // emulator only; the linker takes them only into the binary that declares them.
    let broken = kernel_sources(&broken_dir);
    if !broken.is_empty() {
        let files: Vec<PathBuf> =
            broken.iter().map(|s| emu_src.join("broken").join(s.file_name().unwrap_or_default())).collect();
        let objects = cached_objects(&b, &files);
        let lib = b.create_archive("mesa_broken_emu", &objects);
        cc::emit_link_directives(&b, &lib);
    }
    println!("cargo:rustc-link-lib=pthread");
    if sanitizer_flags().is_some() {
        // The instrumented emulation needs the ASan runtime in every binary of this package that
        // links it (its tests, benches, examples; they run with it preloaded). Given here rather
        // than in RUSTFLAGS, so that no other crate of the graph is built again for it.
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-lasan");
    }
}

/// The directory of `MESA_KERNELS_BUILD_CACHE`, created; `None` when unset (no caching).
fn cache_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env::var_os("MESA_KERNELS_BUILD_CACHE").filter(|v| !v.is_empty())?);
    fs::create_dir_all(&dir).unwrap_or_else(|e| fail(&format!("MESA_KERNELS_BUILD_CACHE={}: {e}", dir.display())));
    Some(dir)
}

/// FNV-1a, 64 bits: the cache key's hash (stable across toolchains, unlike `DefaultHasher`).
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn bytes(&mut self, b: &[u8]) {
        // length first, so that two fields can never run into each other
        for x in (b.len() as u64).to_le_bytes().iter().chain(b) {
            self.0 = (self.0 ^ u64::from(*x)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The inputs every compiled file shares, hashed into `h`: this script (the emulator's source
/// rewriting is in it), every file under `kernels/` but the `.cu` files (headers, the emulator;
/// path relative to the package and content), the target, the compiler (path and
/// `--version`) and its flags with the package's and OUT_DIR's paths taken out.
fn hash_common(h: &mut Fnv, build: &cc::Build) {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    h.bytes(b"mesa-kernels build cache v1");
    h.bytes(env::var("TARGET").unwrap_or_default().as_bytes());
    h.bytes(&fs::read(manifest.join("build.rs")).unwrap_or_default());
    let mut files = Vec::new();
    let mut stack = vec![manifest.join("kernels")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for e in entries.filter_map(|e| e.ok()) {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_none_or(|x| x != "cu") {
                files.push(p);
            }
        }
    }
    files.sort();
    for f in files {
        h.bytes(f.strip_prefix(&manifest).unwrap_or(&f).to_string_lossy().as_bytes());
        h.bytes(&fs::read(&f).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", f.display()))));
    }
    let tool = build.get_compiler();
    h.bytes(tool.path().to_string_lossy().as_bytes());
    let version = std::process::Command::new(tool.path()).arg("--version").output();
    h.bytes(&version.map(|o| o.stdout).unwrap_or_default());
    // nvcc's own environment changes its output without showing in its flags
    for var in ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN"] {
        h.bytes(env::var(var).unwrap_or_default().as_bytes());
    }
    let (out, manifest) = (env::var("OUT_DIR").unwrap_or_default(), manifest.to_string_lossy().into_owned());
    for a in tool.args() {
        h.bytes(a.to_string_lossy().replace(&out, "$OUT_DIR").replace(&manifest, "$SRC").as_bytes());
    }
}

/// The cache key of `file` compiled by `build`: the shared inputs, the file's name and content,
/// and any `.cu` file it includes. Two FNV hashes with different starts: 128 bits.
fn cache_key(build: &cc::Build, file: &Path) -> String {
    let mut h = [Fnv::new(), Fnv::new()];
    h[1].bytes(b"second");
    let text = fs::read_to_string(file).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", file.display())));
    for x in h.iter_mut() {
        hash_common(x, build);
        x.bytes(file.file_name().unwrap_or_default().as_encoded_bytes());
        x.bytes(text.as_bytes());
        for line in text.lines() {
            let inc = line.trim_start().strip_prefix("#include").map(str::trim).unwrap_or("");
            if let Some(name) = inc.strip_prefix('"').and_then(|r| r.strip_suffix('"')).filter(|n| n.ends_with(".cu")) {
                x.bytes(&fs::read(file.with_file_name(name)).unwrap_or_default());
            }
        }
    }
    format!("{:016x}{:016x}", h[0].0, h[1].0)
}

/// `files` compiled by `build` into objects: each found in the cache under its key, the rest
/// compiled (in parallel) and stored. Without a cache, plain `compile_intermediates`.
fn cached_objects(build: &cc::Build, files: &[PathBuf]) -> Vec<PathBuf> {
    let Some(dir) = cache_dir() else {
        return build.clone().files(files).compile_intermediates();
    };
    let cached: Vec<PathBuf> = files
        .iter()
        .map(|f| dir.join(format!("{}-{}.o", f.file_stem().unwrap_or_default().to_string_lossy(), cache_key(build, f))))
        .collect();
    let missing: Vec<usize> = (0..files.len()).filter(|&i| !cached[i].is_file()).collect();
    if !missing.is_empty() {
        let objects = build.clone().files(missing.iter().map(|&i| &files[i])).compile_intermediates();
        for (&i, obj) in missing.iter().zip(&objects) {
            store(obj, &cached[i]);
        }
    }
    cached
}

/// `lib<name>.a` in OUT_DIR from `build` (configured with its one source `file`): copied from
/// the cache when an archive with the same inputs is there, else compiled and stored. The
/// link directives are `build`'s either way.
fn cached_archive(build: &cc::Build, name: &str, file: &Path, out: &Path) {
    let Some(dir) = cache_dir() else {
        build.compile(name);
        return;
    };
    let lib = out.join(format!("lib{name}.a"));
    let cached = dir.join(format!("{name}-{}.a", cache_key(build, file)));
    if fs::copy(&cached, &lib).is_ok() {
        cc::emit_link_directives(build, &lib);
        return;
    }
    build.compile(name);
    store(&lib, &cached);
}

/// Puts a copy of `from` at `to`, atomically: builds that run at once may store the same key.
fn store(from: &Path, to: &Path) {
    let tmp = to.with_extension(format!("tmp{}", std::process::id()));
    if fs::copy(from, &tmp).is_ok() && fs::rename(&tmp, to).is_err() {
        let _ = fs::remove_file(&tmp);
    }
}

/// Whether the machine building the emulator (which also runs it: the emulator is never
/// cross-compiled) has FMA instructions; `required` (the contraction check) asks for them
/// regardless, as before.
fn host_has_fma(required: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        required || std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        required
    }
}

/// `MESA_EMU_SANITIZE=address`: the emulation compiled with AddressSanitizer (the fibers
/// announce their stack switches to it); the test binaries need the ASan runtime linked and
/// preloaded (docs/emulator.md, `.ci/run`).
fn sanitizer_flags() -> Option<Vec<&'static str>> {
    match env::var("MESA_EMU_SANITIZE").as_deref() {
        Err(_) | Ok("") => None,
        Ok("address") => Some(vec!["-fsanitize=address", "-fno-omit-frame-pointer", "-DMESA_EMU_ASAN=1"]),
        Ok(other) => fail(&format!("MESA_EMU_SANITIZE=`{other}`: expected `address` or nothing")),
    }
}

/// The emulator's view of a kernel source: `MESA_EMU_SHARED_POINT(name);` after every
/// `__shared__` declaration (poisoned when a block first passes it), a kernel's
/// `__launch_bounds__(args)` moved into its body as `MESA_EMU_LAUNCH_BOUNDS(args);` (checked
/// against the block size), and `MESA_EMU_LOOP_POINT;` at the top of the braced body of every
/// `for`, `while` and `do` loop whose body holds a block barrier (`__syncthreads`, a group's
/// `sync(`): synccheck then requires every thread at a barrier to be in the same iteration
/// of each such loop around it. Comments and literals are left alone; line numbers are kept.
fn emu_rewrite(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len() + 256);
    let mut i = 0;
    let mut last_ident = String::new();
    let mut pending_bounds: Option<String> = None;
    // the `{` of loop bodies that get a loop point
    let mut loop_bodies = std::collections::BTreeSet::new();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    while i < b.len() {
        let c = b[i];
        if c == b'{' && loop_bodies.remove(&i) {
            out.push_str("{ MESA_EMU_LOOP_POINT;");
            i += 1;
            continue;
        }
        // comments and literals: copied as they are
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            let end = src[i..].find('\n').map_or(b.len(), |k| i + k);
            out.push_str(&src[i..end]);
            i = end;
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let end = src[i + 2..].find("*/").map_or(b.len(), |k| i + 2 + k + 2);
            out.push_str(&src[i..end]);
            i = end;
            continue;
        }
        if c == b'"' || c == b'\'' {
            let mut j = i + 1;
            while j < b.len() && b[j] != c {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            out.push_str(&src[i..end]);
            i = end;
            continue;
        }
        if is_ident(c) && (i == 0 || !is_ident(b[i - 1])) {
            let mut j = i;
            while j < b.len() && is_ident(b[j]) {
                j += 1;
            }
            let word = &src[i..j];
            if word == "__shared__" && last_ident == "extern" {
                // `extern __shared__ T name[];`: the launch's dynamic shared memory
                if let Some(semi) = src[j..].find(';').map(|k| j + k) {
                    if let Some(decl) = dynamic_shared(&src[j..semi]) {
                        let cut = out.rfind("extern").unwrap_or(out.len());
                        out.truncate(cut);
                        out.push_str(&decl);
                        i = semi + 1;
                        last_ident.clear();
                        continue;
                    }
                }
            }
            if word == "__shared__" && last_ident != "extern" {
                // the declaration runs to the next `;` outside brackets
                let (end, names) = shared_declarators(src, j);
                // `__align__(n) __shared__ …`: the alignment is the variable's, so it stays one
                let before = &b[i.saturating_sub(24)..i];
                let aligned = src[..i].trim_end().ends_with(')') && before.windows(9).any(|w| w == b"__align__");
                match boxed_shared(&src[j..end]).filter(|_| !aligned) {
                    Some(decl) => out.push_str(&decl),
                    None => out.push_str(&src[i..end]),
                }
                for n in names {
                    out.push_str(&format!(" MESA_EMU_SHARED_POINT({n});"));
                }
                i = end;
                last_ident.clear();
                continue;
            }
            if matches!(word, "for" | "while" | "do") {
                if let Some(open) = loop_body(src, j, word == "do") {
                    if let Some(close) = matching_brace(src, open) {
                        let body = &src[open..close];
                        // `__syncthreads`, a group's `g.sync()` or `cg::sync(g)` (and, harmlessly, `__syncwarp(`)
                        if body.contains("__syncthreads") || body.contains("sync(") {
                            loop_bodies.insert(open);
                        }
                    }
                }
            }
            if word == "__launch_bounds__" {
                if let Some(close) = matching_paren(src, j) {
                    pending_bounds = Some(src[j + 1..close].to_string());
                    i = close + 1;
                    continue;
                }
            }
            last_ident = word.to_string();
            out.push_str(word);
            i = j;
            continue;
        }
        if c == b'(' && pending_bounds.is_some() {
            // the kernel's parameter list, then its body
            if let Some(close) = matching_paren(src, i) {
                out.push_str(&src[i..=close]);
                i = close + 1;
                let rest = &src[i..];
                let brace = rest.find('{');
                let semi = rest.find(';');
                if let (Some(br), true) = (brace, semi.is_none_or(|s| brace.is_some_and(|br| br < s))) {
                    out.push_str(&rest[..=br]);
                    let args = pending_bounds.take().unwrap_or_default();
                    out.push_str(&format!(" MESA_EMU_LAUNCH_BOUNDS({args});"));
                    i += br + 1;
                } else {
                    pending_bounds = None;
                }
                continue;
            }
        }
        out.push(c as char);
        i += 1;
    }
    out
}

/// From just after `__shared__` at `from`: the index after the declaration's `;` and the
/// names it declares.
fn shared_declarators(src: &str, from: usize) -> (usize, Vec<String>) {
    let b = src.as_bytes();
    let mut depth = 0i32;
    let mut j = from;
    let mut parts = vec![String::new()];
    let mut seen_bracket_or_init = false;
    while j < b.len() {
        let c = b[j];
        match c {
            b'(' | b'[' | b'{' => {
                if depth == 0 && (c == b'[' || c == b'{') {
                    seen_bracket_or_init = true;
                }
                depth += 1;
            }
            b')' | b']' | b'}' => depth -= 1,
            b'=' if depth == 0 => seen_bracket_or_init = true,
            b',' if depth == 0 => {
                parts.push(String::new());
                seen_bracket_or_init = false;
                j += 1;
                continue;
            }
            b';' if depth == 0 => break,
            _ => {}
        }
        if depth == 0 && !seen_bracket_or_init && c != b')' {
            if let Some(p) = parts.last_mut() {
                p.push(c as char);
            }
        } else if depth == 1 && c == b'(' {
            if let Some(p) = parts.last_mut() {
                p.push(' ');
            }
        }
        j += 1;
    }
    let names = parts
        .iter()
        .filter_map(|p| {
            p.split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
                .rfind(|w| !w.is_empty() && !w.as_bytes()[0].is_ascii_digit())
                .map(str::to_string)
        })
        .collect();
    ((j + 1).min(b.len()), names)
}

/// `T name[dims];` (one declarator, no initialiser; the text after `__shared__`) as
/// `MESA_EMU_SHARED(T, name, [dims]);`: heap storage behind a thread-local box
/// (kernels/emu/cuda_emu.h). `None` for anything else, which stays thread-local storage.
fn boxed_shared(decl: &str) -> Option<String> {
    let d = decl.trim().strip_suffix(';')?.trim();
    if d.contains([',', '=', '(', '{']) || d.contains("__align__") {
        return None;
    }
    let dims_at = d.find('[').unwrap_or(d.len());
    let (head, dims) = (d[..dims_at].trim_end(), &d[dims_at..]);
    let name_at = head.rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))? + 1;
    let (ty, name) = (head[..name_at].trim(), &head[name_at..]);
    let name_ok = name.as_bytes().first().is_some_and(|c| !c.is_ascii_digit());
    (!ty.is_empty() && name_ok).then(|| format!("MESA_EMU_SHARED({ty}, {name}, {dims});"))
}

/// The index of the `)` that closes the `(` at or after `open`.
/// `T name[]` (after `extern __shared__`, `__align__(n)` allowed) as a pointer to the
/// launch's dynamic shared memory: `T* name = (T*)::mesa_emu::dynamic_smem();`.
fn dynamic_shared(decl: &str) -> Option<String> {
    let mut d = decl.trim().strip_suffix("[]")?.trim().to_string();
    while let Some(at) = d.find("__align__") {
        let close = matching_paren(&d, at)?;
        d.replace_range(at..=close, " ");
    }
    let name_at = d.rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))? + 1;
    let (ty, name) = (d[..name_at].trim(), &d[name_at..]);
    (!ty.is_empty() && !name.is_empty())
        .then(|| format!("{ty}* {name} = reinterpret_cast<{ty}*>(::mesa_emu::dynamic_smem());"))
}

/// The index of the `{` that opens the body of the loop whose keyword ends at `from`: after
/// the parenthesised header (`for`, `while`) or right away (`do`); `None` for an unbraced
/// body, and for the `while (…);` that ends a `do` loop.
fn loop_body(src: &str, from: usize, is_do: bool) -> Option<usize> {
    let after = if is_do {
        from
    } else {
        let rest = src[from..].trim_start();
        if !rest.starts_with('(') {
            return None;
        }
        matching_paren(src, from)? + 1
    };
    let skipped = src[after..].len() - src[after..].trim_start().len();
    (src.as_bytes().get(after + skipped) == Some(&b'{')).then_some(after + skipped)
}

/// The index of the `}` that closes the `{` at `open`, skipping comments and literals.
fn matching_brace(src: &str, open: usize) -> Option<usize> {
    let b = src.as_bytes();
    let mut depth = 0i32;
    let mut k = open;
    while k < b.len() {
        match b[k] {
            b'/' if b.get(k + 1) == Some(&b'/') => k += src[k..].find('\n').unwrap_or(b.len() - k),
            b'/' if b.get(k + 1) == Some(&b'*') => k += 2 + src[k + 2..].find("*/").map_or(b.len() - k - 2, |e| e + 1),
            q @ (b'"' | b'\'') => {
                k += 1;
                while k < b.len() && b[k] != q {
                    k += if b[k] == b'\\' { 2 } else { 1 };
                }
            }
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
        k += 1;
    }
    None
}

fn matching_paren(src: &str, open: usize) -> Option<usize> {
    let b = src.as_bytes();
    let start = open + src[open..].find('(')?;
    let mut depth = 0i32;
    for (k, &c) in b.iter().enumerate().skip(start) {
        match c {
            b'(' => depth += 1,
            b')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

fn find_nvcc() -> Option<PathBuf> {
    if let Ok(p) = env::var("NVCC") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
        println!("cargo:warning=mesa-kernels-sys: NVCC={} is not a file; looking elsewhere", p.display());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(root) = env::var(var) {
            let p = Path::new(&root).join("bin").join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    println!("cargo:rerun-if-env-changed=PATH");
    let path = env::var_os("PATH")?;
    env::split_paths(&path).map(|d| d.join("nvcc")).find(|p| p.is_file())
}

/// One compute capability from MESA_CUDA_ARCHS.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Arch {
    cc: u32,
    /// `a` suffix: architecture-specific features, SASS only, no forward compatibility.
    specific: bool,
}

impl Arch {
    fn label(&self) -> String {
        format!("sm_{}{}", self.cc, if self.specific { "a" } else { "" })
    }
}

fn parse_archs(s: &str) -> Result<Vec<Arch>, String> {
    let mut v = Vec::new();
    for raw in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let t = raw.trim_start_matches("sm_").trim_start_matches("compute_");
        let (t, specific) = match t.strip_suffix('a') {
            Some(rest) => (rest, true),
            None => (t, false),
        };
        let digits: String =
            if let Some((maj, min)) = t.split_once('.') { format!("{maj}{min}") } else { t.to_string() };
        let cc: u32 = digits
            .parse()
            .map_err(|_| format!("`{raw}` is not a compute capability (expected e.g. 80, 8.0, sm_90, 90a)"))?;
        // what nvcc 13 accepts (`nvcc --list-gpu-arch`)
        const KNOWN: [u32; 13] = [75, 80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121];
        if !KNOWN.contains(&cc) {
            return Err(format!("`{raw}`: compute capability {cc} is not one CUDA 13 knows ({KNOWN:?})"));
        }
        if cc < 80 {
            return Err(format!("`{raw}`: the kernels need bf16 arithmetic, i.e. sm_80 or newer"));
        }
        v.push(Arch { cc, specific });
    }
    if v.is_empty() {
        return Err("empty architecture list".into());
    }
    v.sort();
    v.dedup();
    Ok(v)
}

fn build_cuda(nvcc: &Path, kernels: &Path, sources: &[PathBuf], archs: &[Arch], out: &Path) {
    let mut gencode = Vec::new();
    for a in archs {
        let name = if a.specific { format!("{}a", a.cc) } else { a.cc.to_string() };
        gencode.push(format!("-gencode=arch=compute_{name},code=sm_{name}"));
    }
    if let Some(ptx) = archs.iter().filter(|a| !a.specific).max() {
        gencode.push(format!("-gencode=arch=compute_{0},code=compute_{0}", ptx.cc));
    }
    // The wheel layout (nvidia/cu13/{bin,lib}) and the toolkit layout (bin, lib64).
    let root = nvcc.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or_default();
    for lib in [root.join("lib"), root.join("lib64")] {
        if lib.join("libcudart_static.a").is_file() {
            println!("cargo:rustc-link-search=native={}", lib.display());
        }
    }
    // cc picks nvcc from NVCC (and then wraps host flags in -Xcompiler); set it to what we
    // found before any thread starts.
    env::set_var("NVCC", nvcc);
    // One cc::Build per file: with a single .cu per build, cc does not compile with
    // relocatable device code, so each kernel is optimised whole. Built in parallel.
    std::thread::scope(|scope| {
        for src in sources {
            let gencode = gencode.clone();
            scope.spawn(move || {
                let stem = src.file_stem().and_then(|s| s.to_str()).unwrap_or("kernel").to_string();
                let mut b = cc::Build::new();
                b.cuda(true)
                    .cudart("static")
                    .include(kernels.join("include"))
                    .include(kernels)
                    // cc passes -G (unoptimised device code) in debug profiles: never for kernels.
                    .debug(false)
                    .opt_level(3)
                    .flag("-std=c++17")
                    .flag("-Xptxas=-warn-spills")
                    // The fatbin goes into every test and bench binary: compressed for size it is
                    // about a tenth of nvcc's default (decompressed once, at module load).
                    .flag("-compress-mode=size")
                    .warnings(false)
                    .file(src);
                for g in &gencode {
                    b.flag(g);
                }
                let name = format!("mesa_kernels_cuda_{stem}");
                cached_archive(&b, &name, src, out);
            });
        }
    });
    for lib in ["dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib={lib}");
    }
}

/// Without nvcc: every `mesa_*` entry point declared in the headers returns
/// MESA_STATUS_CUDA_NOT_BUILT. The list comes from the MESA_DECLARE_ENTRY lines, so it
/// cannot miss one.
fn build_cuda_stub(kernels: &Path, out: &Path) {
    let mut body = String::from("#include \"mesa_kernels.h\"\n#include <stddef.h>\n");
    let include = kernels.join("include");
    let mut headers: Vec<PathBuf> = fs::read_dir(&include)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", include.display())))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    headers.sort();
    for h in headers {
        let text = fs::read_to_string(&h).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", h.display())));
        for line in text.lines() {
            let line = line.trim();
            if let Some(rest) = line.strip_prefix("MESA_DECLARE_ENTRY(") {
                let inner = rest.trim_end_matches(')');
                if let Some((name, args)) = inner.split_once(',') {
                    let (name, args) = (name.trim(), args.trim());
                    body.push_str(&format!(
                        "MesaStatus mesa_{name}(const {args}* args, void* stream) {{\n  (void)args; (void)stream;\n  return MESA_STATUS_CUDA_NOT_BUILT;\n}}\n"
                    ));
                }
            }
        }
    }
    let stub = out.join("mesa_cuda_stub.c");
    fs::write(&stub, body).unwrap_or_else(|e| fail(&format!("cannot write stub: {e}")));
    cc::Build::new().include(&include).file(&stub).warnings(false).compile("mesa_kernels_cuda_stub");
}

#[cfg(feature = "regenerate-bindings")]
fn regenerate_bindings(manifest: &Path, out: &Path) {
    let header = manifest.join("kernels").join("include").join("mesa_kernels.h");
    let generated = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_arg(format!("-I{}", manifest.join("kernels").join("include").display()))
        .allowlist_type("Mesa.*")
        .allowlist_function("mesa_.*")
        .allowlist_var("MESA_.*")
        .use_core()
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_copy(true)
        .derive_debug(true)
        .layout_tests(true)
        .generate_comments(true)
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen: {e}")))
        .to_string();
    let text = format!(
        "// Generated by bindgen from kernels/include/mesa_kernels.h — do not edit.\n\
         // Regenerate: MESA_WRITE_BINDINGS=1 cargo build -p mesa-kernels-sys --features regenerate-bindings\n{generated}"
    );
    let _ = fs::write(out.join("bindings.rs"), &text);
    let committed = manifest.join("src").join("bindings.rs");
    let current = fs::read_to_string(&committed).unwrap_or_default();
    if current != text {
        if env::var("MESA_WRITE_BINDINGS").is_ok_and(|v| v == "1") {
            fs::write(&committed, text).unwrap_or_else(|e| fail(&format!("cannot write bindings: {e}")));
            println!("cargo:warning=mesa-kernels-sys: rewrote src/bindings.rs");
        } else {
            fail(
                "src/bindings.rs is stale: it differs from what bindgen generates from \
                 kernels/include/mesa_kernels.h. Run: MESA_WRITE_BINDINGS=1 cargo build -p \
                 mesa-kernels-sys --features regenerate-bindings",
            );
        }
    }
}
