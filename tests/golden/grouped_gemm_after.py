def forward(self, L_x_ : torch.Tensor, L_self_modules_router_parameters_weight_ : torch.nn.parameter.Parameter, L_self_parameters_gate_up_proj_ : torch.nn.parameter.Parameter, L_self_parameters_down_proj_ : torch.nn.parameter.Parameter):
    l_x_ = L_x_
    l_self_modules_router_parameters_weight_ = L_self_modules_router_parameters_weight_
    l_self_parameters_gate_up_proj_ = L_self_parameters_gate_up_proj_
    l_self_parameters_down_proj_ = L_self_parameters_down_proj_
    x_TH = l_x_.reshape(-1, 32);  l_x_ = None
    logits_TE = torch._C._nn.linear(x_TH, l_self_modules_router_parameters_weight_, None);  l_self_modules_router_parameters_weight_ = None
    scores_TE = torch.nn.functional.softmax(logits_TE, dim = -1, dtype = torch.float32);  logits_TE = None
    topk = torch.topk(scores_TE, k = 2, dim = -1);  scores_TE = None
    topk_w_TK = topk[0]
    sum_1 = topk_w_TK.sum(dim = -1, keepdim = True)
    add = sum_1 + 1e-20;  sum_1 = None
    topk_w_TK_1 = topk_w_TK / add;  topk_w_TK = add = None
    topk_w_TK_2 = topk_w_TK_1 * 1.0;  topk_w_TK_1 = None
    topk_w_TK_3 = topk_w_TK_2.to(torch.float32);  topk_w_TK_2 = None
    getitem_9 = topk[1];  topk = None
    experts_default = torch.ops.hiermoe.experts_composite_gate_up.default(x_TH, getitem_9, topk_w_TK_3, l_self_parameters_gate_up_proj_, 'gate_first', l_self_parameters_down_proj_, None, None, None, 'silu');  x_TH = getitem_9 = topk_w_TK_3 = l_self_parameters_gate_up_proj_ = l_self_parameters_down_proj_ = None
    reshape_3 = experts_default.reshape(2, 8, 32);  experts_default = None
    return (reshape_3,)
