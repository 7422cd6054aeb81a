//! The fixture's text as character ids, the batch sampler shared by every run, and the
//! bigram baseline.
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

/// The training and validation text as ids of one character vocabulary.
pub struct Corpus {
    /// The vocabulary: the distinct bytes of the training text, sorted.
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
        let ids = |text: &[u8]| -> Result<Vec<u32>, String> {
            text.iter()
                .map(|&c| match index[usize::from(c)] {
                    u32::MAX => Err(format!("byte {c:#04x} of the validation text is not in the training text")),
                    i => Ok(i),
                })
                .collect()
        };
        Ok(Corpus { train: ids(&train)?, val: ids(&val)?, vocab })
    }

    /// Bigram cross-entropy in nats per character over the first `len` characters of the
    /// validation text: a bigram fitted on the training split with add-one (Laplace)
    /// smoothing, `p(b | a) = (n(a, b) + 1) / (n(a) + V)`, averaged over the `len − 1`
    /// transitions — the positions [`val_windows`] scores.
    pub fn bigram_val_loss(&self, len: usize) -> f64 {
        let v = self.vocab.len();
        let mut pair = vec![0u64; v * v];
        let mut first = vec![0u64; v];
        for w in self.train.windows(2) {
            pair[w[0] as usize * v + w[1] as usize] += 1;
            first[w[0] as usize] += 1;
        }
        let val = &self.val[..len.min(self.val.len())];
        let nll: f64 = val
            .windows(2)
            .map(|w| {
                let (a, b) = (w[0] as usize, w[1] as usize);
                -((pair[a * v + b] + 1) as f64 / (first[a] + v as u64) as f64).ln()
            })
            .sum();
        nll / (val.len() - 1) as f64
    }
}

/// splitmix64: the example's one random generator (initialisation and data order), so that
/// every run sees the same numbers on every machine.
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

    /// Uniform in `[0, 1)` (53 bits).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// Inputs `[B, T]` and next-character targets `[B, T]` (u32) of windows starting at `starts`.
pub fn windows(ids: &[u32], starts: &[usize], t: usize, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(starts.len() * t);
    let mut y = Vec::with_capacity(starts.len() * t);
    for &s in starts {
        x.extend_from_slice(&ids[s..s + t]);
        y.extend_from_slice(&ids[s + 1..s + t + 1]);
    }
    Ok((Tensor::from_vec(x, (starts.len(), t), device)?, Tensor::from_vec(y, (starts.len(), t), device)?))
}

/// The window starts of every training step: one sequence per data seed, the same for every
/// run that shares the seed (runs are paired by it).
pub fn train_order(len: usize, t: usize, batch: usize, steps: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut rng = SplitMix(seed);
    let span = (len - t - 1) as u64;
    (0..steps).map(|_| (0..batch).map(|_| (rng.next_u64() % span) as usize).collect()).collect()
}

/// Windows of `t` characters that score every transition of `text[..len]` exactly once:
/// `(start, skip)` with the window's targets `text[start + 1 ..= start + t]`, of which the
/// first `skip` were scored by the window before (only the last window, aligned to the
/// end, overlaps). Each position is predicted from the characters since its window's start.
pub fn val_windows(len: usize, t: usize) -> Vec<(usize, usize)> {
    let last = len.saturating_sub(t + 1);
    let mut w: Vec<(usize, usize)> = (0..=last).step_by(t).map(|s| (s, 0)).collect();
    if let Some(&(s, _)) = w.last() {
        if s < last {
            w.push((last, s + t - last));
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_windows_score_every_transition_once() {
        for (len, t) in [(2048, 32), (2049, 32), (2081, 32), (33, 32), (34, 32), (100, 7), (218_307, 32)] {
            let mut scored = vec![0u32; len];
            for (start, skip) in val_windows(len, t) {
                assert!(start + t < len, "window {start} of {t} past {len}");
                for n in &mut scored[start + 1 + skip..=start + t] {
                    *n += 1;
                }
            }
            assert_eq!(scored[0], 0, "the first character has no predecessor");
            assert!(scored[1..].iter().all(|&n| n == 1), "len {len}, t {t}: {:?}", &scored[..8]);
        }
    }

    #[test]
    fn bigram_by_hand() {
        // vocabulary {a, b}; train "aab": n(a,a) = 1, n(a,b) = 1, n(a) = 2; validation "ab":
        // p(b | a) = (1 + 1) / (2 + 2) = 1/2, one transition
        let c = Corpus { vocab: vec![b'a', b'b'], train: vec![0, 0, 1], val: vec![0, 1, 1] };
        assert!((c.bigram_val_loss(2) - std::f64::consts::LN_2).abs() < 1e-15);
        // "abb": the second transition b → b: n(b) = 0, p = (0 + 1) / (0 + 2)
        assert!((c.bigram_val_loss(3) - std::f64::consts::LN_2).abs() < 1e-15);
    }
}
