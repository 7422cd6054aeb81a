//! Modules mirroring burn-nn's `Gelu`, `LayerNorm`, `RmsNorm` and `Linear`: the same parameters (names,
//! shapes, initialisation), plus `bits`, the width of the codes kept for backward. A model
//! swaps an op by changing the type of its field and its config.
use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::tensor::{Device, Tensor};

use crate::config::Codes;

use mesa_kernels::GeluForm;

/// Config of [`Gelu`].
#[derive(Config, Debug)]
pub struct GeluConfig {
    /// The tanh approximation (burn's `gelu_approximate`) instead of erf.
    #[config(default = false)]
    pub approximate: bool,
    /// Bits per code of the saved input: 8, 4 or 2.
    #[config(default = 8)]
    pub bits: u32,
}

impl GeluConfig {
    /// The module (no parameters).
    #[must_use]
    pub fn init(&self) -> Gelu {
        Gelu { approximate: self.approximate, bits: self.bits }
    }
}

/// GELU keeping the codes of its input for backward ([`crate::gelu`]).
#[derive(Module, Debug)]
pub struct Gelu {
    /// The tanh approximation instead of erf.
    pub approximate: bool,
    /// Bits per code: 8, 4 or 2.
    pub bits: u32,
}

impl Gelu {
    /// `gelu(x)`, any shape.
    ///
    /// # Errors
    /// As [`crate::gelu`].
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> crate::Result<Tensor<D>> {
        let form = if self.approximate { GeluForm::Tanh } else { GeluForm::Erf };
        crate::gelu(x, form, Codes::bits(self.bits))
    }
}

/// Config of [`LayerNorm`].
#[derive(Config, Debug)]
pub struct LayerNormConfig {
    /// `C`, the size of the normalised last axis.
    pub d_model: usize,
    /// Added to the variance.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Bits per code of the saved `x̂`: 8, 4 or 2.
    #[config(default = 8)]
    pub bits: u32,
}

impl LayerNormConfig {
    /// The module: `gamma` ones `[C]`, `beta` zeros `[C]` (as burn-nn's).
    #[must_use]
    pub fn init(&self, device: &Device) -> LayerNorm {
        LayerNorm {
            gamma: Initializer::Ones.init([self.d_model], device),
            beta: Initializer::Zeros.init([self.d_model], device),
            epsilon: self.epsilon,
            bits: self.bits,
        }
    }
}

/// LayerNorm over the last axis keeping the codes of `x̂` for backward ([`crate::layer_norm`]).
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// Scale `[C]`.
    pub gamma: Param<Tensor<1>>,
    /// Shift `[C]`.
    pub beta: Param<Tensor<1>>,
    /// Added to the variance.
    pub epsilon: f64,
    /// Bits per code: 8, 4 or 2.
    pub bits: u32,
}

impl LayerNorm {
    /// `x` `[.., C]` → `[.., C]`.
    ///
    /// # Errors
    /// As [`crate::layer_norm`].
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> crate::Result<Tensor<D>> {
        crate::layer_norm(x, self.gamma.val(), self.beta.val(), self.epsilon, Codes::bits(self.bits))
    }
}

/// Config of [`RmsNorm`].
#[derive(Config, Debug)]
pub struct RmsNormConfig {
    /// `C`, the size of the normalised last axis.
    pub d_model: usize,
    /// Added to the mean square.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Bits per code of the saved `x̂`: 8, 4 or 2.
    #[config(default = 8)]
    pub bits: u32,
}

impl RmsNormConfig {
    /// The module: `gamma` ones `[C]` (as burn-nn's).
    #[must_use]
    pub fn init(&self, device: &Device) -> RmsNorm {
        RmsNorm { gamma: Initializer::Ones.init([self.d_model], device), epsilon: self.epsilon, bits: self.bits }
    }
}

/// RMSNorm over the last axis keeping the codes of `x̂` for backward ([`crate::rms_norm`]).
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// Scale `[C]`.
    pub gamma: Param<Tensor<1>>,
    /// Added to the mean square.
    pub epsilon: f64,
    /// Bits per code: 8, 4 or 2.
    pub bits: u32,
}

impl RmsNorm {
    /// `x` `[.., C]` → `[.., C]`.
    ///
    /// # Errors
    /// As [`crate::rms_norm`].
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> crate::Result<Tensor<D>> {
        crate::rms_norm(x, self.gamma.val(), self.epsilon, Codes::bits(self.bits))
    }
}

/// Config of [`Linear`].
#[derive(Config, Debug)]
pub struct LinearConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    /// Whether the layer has a bias.
    #[config(default = true)]
    pub bias: bool,
    /// Initialiser of weight and bias (burn-nn's default: Kaiming uniform, gain 1/√3).
    #[config(default = "Initializer::KaimingUniform{gain:1.0/3.0f64.sqrt(), fan_out_only:false}")]
    pub initializer: Initializer,
    /// Bits per code of the saved input: 8, 4 or 2.
    #[config(default = 8)]
    pub bits: u32,
}

impl LinearConfig {
    /// The module: `weight` `[d_input, d_output]`, `bias` `[d_output]`, initialised with
    /// fan-in `d_input` and fan-out `d_output` (as burn-nn's row layout).
    #[must_use]
    pub fn init(&self, device: &Device) -> Linear {
        let weight =
            self.initializer.init_with([self.d_input, self.d_output], Some(self.d_input), Some(self.d_output), device);
        let bias = self
            .bias
            .then(|| self.initializer.init_with([self.d_output], Some(self.d_input), Some(self.d_output), device));
        Linear { weight, bias, bits: self.bits }
    }
}

/// A linear layer keeping the codes of its input for backward ([`crate::linear`]).
#[derive(Module, Debug)]
pub struct Linear {
    /// `[d_input, d_output]`.
    pub weight: Param<Tensor<2>>,
    /// `[d_output]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// Bits per code: 8, 4 or 2.
    pub bits: u32,
}

impl Linear {
    /// `x` `[.., d_input]` → `[.., d_output]`.
    ///
    /// # Errors
    /// As [`crate::linear`].
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> crate::Result<Tensor<D>> {
        crate::linear(x, self.weight.val(), self.bias.as_ref().map(Param::val), Codes::bits(self.bits))
    }
}
