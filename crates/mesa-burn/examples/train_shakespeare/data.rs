//! The fixture's text as character ids, the example's random generator, the training
//! batches of a seed and the validation windows.
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};

/// The training and validation text as ids of one character vocabulary.
pub struct Corpus {
    /// The distinct bytes of the training text, sorted.
    pub vocab: Vec<u8>,
    /// The training split as ids.
    pub train: Vec<u32>,
    /// The validation split as ids.
    pub val: Vec<u32>,
}

/// The repository's `fixtures/` (where this example was built from).
pub fn default_fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

impl Corpus {
    /// Reads `shakespeare_{train,val}.txt` from `dir` (fixtures/README.md).
    pub fn load(dir: &Path) -> Result<Self, String> {
        let read = |n: &str| std::fs::read(dir.join(n)).map_err(|e| format!("{}: {e}", dir.join(n).display()));
        let (train, val) = (read("shakespeare_train.txt")?, read("shakespeare_val.txt")?);
        let mut vocab = train.clone();
        vocab.sort_unstable();
        vocab.dedup();
        let mut index = [u32::MAX; 256];
        for (i, &c) in vocab.iter().enumerate() {
            index[usize::from(c)] = i as u32;
        }
        let val = val
            .iter()
            .map(|&c| match index[usize::from(c)] {
                u32::MAX => Err(format!("byte {c:#04x} of the validation text is not in the training text")),
                i => Ok(i),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let train = train.iter().map(|&c| index[usize::from(c)]).collect();
        Ok(Corpus { vocab, train, val })
    }
}

/// splitmix64: the example's one random generator (initialisation and data order), so that
/// both variants of a seed see the same numbers.
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let uniform = |r: &mut Self| (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let u1 = 1.0 - uniform(self);
        let u2 = uniform(self);
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// The window starts of every training step for a data seed.
pub fn train_order(len: usize, t: usize, batch: usize, steps: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut rng = SplitMix(seed);
    let span = (len - t - 1) as u64;
    (0..steps).map(|_| (0..batch).map(|_| (rng.next_u64() % span) as usize).collect()).collect()
}

/// Inputs `[B, T]` and next-character targets `[B, T]` of the windows starting at `starts`.
pub fn windows(ids: &[u32], starts: &[usize], t: usize, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let mut x = Vec::with_capacity(starts.len() * t);
    let mut y = Vec::with_capacity(starts.len() * t);
    for &s in starts {
        x.extend(ids[s..s + t].iter().map(|&i| i64::from(i)));
        y.extend(ids[s + 1..s + t + 1].iter().map(|&i| i64::from(i)));
    }
    let shape = [starts.len(), t];
    (Tensor::from_data(TensorData::new(x, shape), device), Tensor::from_data(TensorData::new(y, shape), device))
}

/// Starts of the non-overlapping windows of `t` characters that fit in `text[..len]` with
/// their targets: every transition up to the last whole window is scored once.
pub fn val_starts(len: usize, t: usize) -> Vec<usize> {
    (0..).map(|i| i * t).take_while(|&s| s + t < len).collect()
}
